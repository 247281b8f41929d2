"""Delivering a stored result, only while the delivery payment condition holds."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.urls import reverse

from core.clock import now_or
from core.errors import DomainError, ErrorCode
from fulfillment import selectors as fulfillment_selectors
from fulfillment import services as fulfillment_services
from payments.models import PaymentAttempt
from purchases.models import Purchase
from purchases.selectors import purchase_status

PAY = Purchase.PaymentState
RUN = Purchase.FulfillmentState


@dataclass(frozen=True)
class Delivery:
    body: bytes
    content_type: str
    sha256_b64: str
    receipt_url: str


class DeliveryPending(Exception):
    """The work is paid for and still running: poll again."""

    def __init__(self, status: dict[str, Any]) -> None:
        super().__init__("pending")
        self.status = status


def purchase_result_deliver(
    *,
    purchase: Purchase,
    now: datetime | None = None,
    created_with: PaymentAttempt | None = None,
) -> Delivery:
    """Return the stored result and note its first delivery.

    `created_with`: the purchase was created in this request with this payment (see
    purchase_status), so a pending answer reads nothing more.

    Raises DeliveryPending while the paid work runs, and DomainError: payment_not_complete,
    execution_failed, result_expired (naming the receipt).
    """
    now = now_or(now)
    if not purchase.is_payment_sufficient_for_execution():
        raise DomainError(
            ErrorCode.PAYMENT_NOT_COMPLETE,
            purchase=purchase.ref,
            extra={"payment_state": purchase.payment_state},
        )
    if purchase.fulfillment_state in (RUN.NOT_STARTED, RUN.QUEUED, RUN.RUNNING):
        raise DeliveryPending(
            purchase_status(purchase=purchase, now=now, created_with=created_with)
        )
    if purchase.fulfillment_state in (RUN.FAILED, RUN.UNKNOWN):
        status = purchase_status(purchase=purchase, now=now)
        raise DomainError(
            ErrorCode.EXECUTION_FAILED,
            purchase=purchase.ref,
            extra={"remedy": status["remedy"], "execution_state": purchase.fulfillment_state},
        )
    result = fulfillment_selectors.result_with_receipt(purchase_id=purchase.pk)
    public_id = getattr(result, "receipt_public_id", None)
    receipt_url = (
        reverse("api:receipt-detail", kwargs={"public_id": public_id}) if public_id else ""
    )
    if result is None or not receipt_url:
        raise RuntimeError(f"purchase {purchase.ref} succeeded without a stored result and receipt")
    receipt_url = reverse("api:receipt-detail", kwargs={"public_id": public_id})
    if fulfillment_selectors.result_is_expired(result=result, now=now):
        raise DomainError(
            ErrorCode.RESULT_EXPIRED, purchase=purchase.ref, extra={"receipt": receipt_url}
        )
    if result.first_delivered_at is None:
        fulfillment_services.result_mark_delivered(result=result, now=now)
    digest = base64.b64encode(bytes.fromhex(result.sha256)).decode()
    return Delivery(bytes(result.body), result.content_type, digest, receipt_url)


def receipt_public(*, public_id: str) -> dict[str, Any]:
    """The public receipt. Raises DomainError: receipt_not_found."""
    receipt = fulfillment_selectors.receipt_get(public_id=public_id)
    if receipt is None:
        raise DomainError(ErrorCode.RECEIPT_NOT_FOUND)
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
    }
