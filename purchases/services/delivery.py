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


def _receipt_url(purchase: Purchase) -> str | None:
    receipt = fulfillment_selectors.receipt_for_purchase(purchase_id=purchase.pk)
    return (
        reverse("api:receipt-detail", kwargs={"public_id": receipt.public_id}) if receipt else None
    )


def purchase_result_deliver(*, purchase: Purchase, now: datetime | None = None) -> Delivery:
    """Return the stored result and note its first delivery.

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
        raise DeliveryPending(purchase_status(purchase=purchase, now=now))
    if purchase.fulfillment_state in (RUN.FAILED, RUN.UNKNOWN):
        status = purchase_status(purchase=purchase, now=now)
        raise DomainError(
            ErrorCode.EXECUTION_FAILED,
            purchase=purchase.ref,
            extra={"remedy": status["remedy"], "execution_state": purchase.fulfillment_state},
        )
    result = fulfillment_selectors.result_for_purchase(purchase_id=purchase.pk)
    receipt_url = _receipt_url(purchase)
    if result is None or receipt_url is None:
        raise RuntimeError(f"purchase {purchase.ref} succeeded without a stored result and receipt")
    if fulfillment_selectors.result_is_expired(result=result, now=now):
        raise DomainError(
            ErrorCode.RESULT_EXPIRED, purchase=purchase.ref, extra={"receipt": receipt_url}
        )
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
