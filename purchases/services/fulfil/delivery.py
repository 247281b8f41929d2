"""Delivering a stored result, only while the delivery payment condition holds."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.urls import reverse

from core.actors import Actor
from core.clock import now_or
from core.errors import DomainError, ErrorCode
from fulfillment import selectors as fulfillment_selectors
from fulfillment.models import Receipt, Result
from payments.models import PaymentAttempt, Rail
from purchases import event_subjects as subjects
from purchases import sql
from purchases.events import event_note
from purchases.models import Purchase
from purchases.selectors import PENDING_RUN_STATES, pending_retry_after, purchase_status
from purchases.services.fulfil.receipts import (
    is_final,
    purchase_receipt_issue,
    receipt_document,
    signed_receipt_extra,
)

PAY = Purchase.PaymentState
RUN = Purchase.FulfillmentState


@dataclass(frozen=True)
class Delivery:
    body: bytes
    content_type: str
    sha256_b64: str
    receipt_url: str
    # The signed receipt's JSON text; "" while the payment is not final (none is issued yet).
    signed_receipt: str = ""


class DeliveryPending(Exception):
    """The work is paid for and still running, or its outcome is not known yet (checked
    again automatically): poll again after `retry_after` seconds."""

    def __init__(self, status: dict[str, Any], retry_after: int) -> None:
        super().__init__("pending")
        self.status = status
        self.retry_after = retry_after


def purchase_result_deliver(
    *,
    purchase: Purchase,
    now: datetime | None = None,
    created_with: PaymentAttempt | None = None,
    channel: str = "api",
    attempt: PaymentAttempt | None = None,
) -> Delivery:
    """Return the stored result and put this delivery on the timeline: the first
    (`result.delivered`, stamping the result) or a later one (`result.redelivered`), with
    `channel` (api, x402_paid_url, capability_url); a request past retention is noted too.

    `created_with`: the purchase was created in this request with this payment (see
    purchase_status), so a pending answer reads nothing more. `attempt`: the purchase's
    latest payment attempt, if already read: an x402 settlement it shows not final yet
    needs no look for a receipt to issue (purchases.services.fulfil.receipts).

    Raises DeliveryPending while the paid work runs or its outcome is unknown (never told
    as failed: it is checked again), and DomainError: payment_not_complete, execution_failed
    (the executor said so for sure), result_expired (naming the receipt).
    """
    now = now_or(now)
    if (
        purchase.is_payment_sufficient_for_execution()
        and purchase.fulfillment_state in PENDING_RUN_STATES
    ):
        status = purchase_status(purchase=purchase, now=now, created_with=created_with)
        raise DeliveryPending(status, pending_retry_after(status=status, now=now))
    # The authorization flow runs on a held payment but releases only a settled one.
    if not purchase.is_payment_sufficient_for_delivery():
        raise DomainError(
            ErrorCode.PAYMENT_NOT_COMPLETE,
            purchase=purchase.ref,
            extra={"payment_state": purchase.payment_state},
        )
    if purchase.fulfillment_state in PENDING_RUN_STATES:
        status = purchase_status(purchase=purchase, now=now, created_with=created_with)
        raise DeliveryPending(status, pending_retry_after(status=status, now=now))
    if purchase.fulfillment_state == RUN.FAILED:
        status = purchase_status(purchase=purchase, now=now)
        raise DomainError(
            ErrorCode.EXECUTION_FAILED,
            purchase=purchase.ref,
            extra={"remedy": status["remedy"], "execution_state": purchase.fulfillment_state},
        )
    result, public_id, signed = _result_and_receipt(purchase)
    receipt_url = (
        reverse("api:receipt-detail", kwargs={"public_id": public_id}) if public_id else ""
    )
    if result is None or not receipt_url:
        raise RuntimeError(f"purchase {purchase.ref} succeeded without a stored result and receipt")
    receipt_url = reverse("api:receipt-detail", kwargs={"public_id": public_id})
    if fulfillment_selectors.result_is_expired(result=result, now=now):
        event_note(
            subject=subjects.RESULT_RETENTION_EXPIRED,
            purchase=purchase,
            actor=Actor.agent(purchase.payer),
            reason_code=ErrorCode.RESULT_EXPIRED,
            evidence={
                "result": result.pk,
                "channel": channel,
                "expired_at": result.expires_at.isoformat(),
                "receipt": public_id,
            },
        )
        signed = signed or _receipt_if_final(purchase, attempt)
        raise DomainError(
            ErrorCode.RESULT_EXPIRED,
            purchase=purchase.ref,
            extra={"receipt": receipt_url, **signed_receipt_extra(signed)},
        )
    _delivery_record(
        purchase=purchase, result=result, receipt_public_id=str(public_id), channel=channel, now=now
    )
    digest = base64.b64encode(bytes.fromhex(result.sha256)).decode()
    signed = signed or _receipt_if_final(purchase, attempt)
    return Delivery(bytes(result.body), result.content_type, digest, receipt_url, signed)


def _receipt_if_final(purchase: Purchase, attempt: PaymentAttempt | None) -> str:
    """No receipt is stored yet: issue it if the payment is final now. An x402 settlement
    already read as not final costs nothing more: it gets none (the answer says pending)."""
    if purchase.rail != Rail.PREPAID and attempt is not None and not is_final(attempt):
        return ""
    return purchase_receipt_issue(purchase=purchase, attempt=attempt)


def _result_and_receipt(purchase: Purchase) -> tuple[Result | None, str | None, str]:
    """The result, its receipt's public id and signed text: as read with the purchase when
    it was (purchase_get_for_buyer(with_result=True)), else in one query."""
    if Purchase.result.is_cached(purchase) and Purchase.receipt.is_cached(purchase):  # type: ignore[attr-defined]
        result = getattr(purchase, "result", None)
        receipt = getattr(purchase, "receipt", None)
        if receipt is None:
            return result, None, ""
        return result, receipt.public_id, receipt.signed
    result = fulfillment_selectors.result_with_receipt(purchase_id=purchase.pk)
    return (
        result,
        getattr(result, "receipt_public_id", None),
        getattr(result, "receipt_signed", None) or "",
    )


def _delivery_record(
    *, purchase: Purchase, result: Result, receipt_public_id: str, channel: str, now: datetime
) -> None:
    first = result.first_delivered_at
    evidence = {
        "result": result.pk,
        "channel": channel,
        "sha256": result.sha256,
        "bytes": len(result.body),
        "receipt": receipt_public_id,
        "first_delivered_at": first.isoformat() if first else now.isoformat(),
    }
    sql.result_delivery_note(result=result, purchase=purchase, evidence=evidence, now=now)


# A public receipt fetch goes on the timeline at most once per purchase per window: anyone
# holding the link can fetch it, so noting every GET would let them grow the timeline
# without bound (and cost a write per read). An hour still shows support when it was used.
RECEIPT_FETCH_NOTE_WINDOW = timedelta(hours=1)

# Receipts are public: the fetch is by whoever holds the link.
_RECEIPT_FETCHER = Actor.agent("public")


def receipt_public(*, public_id: str, now: datetime | None = None) -> dict[str, Any]:
    """The public receipt. Its fetch goes on the purchase's timeline (`receipt.fetched`) if
    none was noted in the last RECEIPT_FETCH_NOTE_WINDOW; other fetches write nothing.
    Raises DomainError: receipt_not_found."""
    now = now_or(now)
    receipt = fulfillment_selectors.receipt_get(public_id=public_id)
    if receipt is None:
        raise DomainError(ErrorCode.RECEIPT_NOT_FOUND)
    noted_at = receipt.last_fetch_noted_at
    if noted_at is None or noted_at <= now - RECEIPT_FETCH_NOTE_WINDOW:
        _receipt_fetch_note(receipt, now)
    return {
        "receipt": receipt.public_id,
        "purchase": receipt.purchase.ref,
        "payer": receipt.payer,
        "amount": str(receipt.amount),
        "asset": receipt.asset,
        "network": receipt.network,
        "transaction": receipt.transaction,
        "body_sha256": receipt.body_sha256,
        "delivered_at": receipt.delivered_at.isoformat(),
        # The signed receipt once the payment is final (docs/receipts.md); null until then.
        "signed": receipt_document(receipt.signed) if receipt.signed else None,
    }


def _receipt_fetch_note(receipt: Receipt, now: datetime) -> None:
    # Read with the receipt: the fetch it was noted before, if any (None: this is the first).
    previous = receipt.last_fetch_noted_at
    evidence = {
        "receipt": receipt.public_id,
        "previous_note_at": previous.isoformat() if previous else None,
        "window_seconds": int(RECEIPT_FETCH_NOTE_WINDOW.total_seconds()),
    }
    sql.receipt_fetch_note(
        receipt=receipt,
        actor=_RECEIPT_FETCHER,
        evidence=evidence,
        now=now,
        due_from=now - RECEIPT_FETCH_NOTE_WINDOW,
    )
