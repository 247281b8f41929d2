"""Reads of buyers' refund requests: the document the buyer polls (and webhooks carry).

The buyer's `status` follows the x402 refund-extension proposal's words: `pending` (open, or
approved and not yet paid), `executed` (the refund it fed was paid back), `denied` (by staff,
with their reason code; or the proposal it fed was declined by finance).
"""

from __future__ import annotations

from typing import Any

from django.urls import reverse

from core.clock import utc_seconds
from core.errors import DomainError, ErrorCode
from fulfillment import selectors as fulfillment_selectors
from fulfillment.receipt_signing import signing_key
from fulfillment.refund_receipt_signing import REFUND_RECEIPT_VERSION, refund_receipt_sign
from payments.models import PaymentAttempt, Refund
from purchases.models import Buyer, Purchase, RefundRequest

# Finance declined the proposal an approved request fed.
REFUND_DECLINED = "refund_declined"
DENIAL_WORDS = {
    **RefundRequest.DENIAL_CODES,
    REFUND_DECLINED: "The seller's finance team declined the refund after review.",
}


def refund_request_status(request: RefundRequest) -> tuple[str, str]:
    """(status, reason code) as the buyer reads them."""
    if request.state == RefundRequest.State.DENIED:
        return "denied", request.denial_code
    refund = request.refund if request.refund_id else None
    if refund is None:
        return "pending", ""
    if refund.state == Refund.State.PAID:
        return "executed", ""
    if refund.state == Refund.State.DECLINED:
        return "denied", REFUND_DECLINED
    return "pending", ""


def refund_request_document(*, request: RefundRequest) -> dict[str, Any]:
    """The refund request as the buyer sees it. Never the idempotency key nor the
    signature: the document may travel (webhooks)."""
    status, reason_code = refund_request_status(request)
    refund = request.refund if request.refund_id else None
    purchase_ref = request.purchase.ref
    return {
        "id": request.public_id,
        "purchase": purchase_ref,
        "status": status,
        "decision": None if request.state == RefundRequest.State.OPEN else str(request.state),
        "reason_code": reason_code or None,
        "reason_message": DENIAL_WORDS.get(reason_code) if reason_code else None,
        "amount": str(request.amount),
        "asset": request.asset,
        "reason": request.reason,
        "channel": request.channel,
        "requested_by": request.requested_by,
        "created_at": request.created_at.isoformat(),
        "decide_by": request.deadline_at.isoformat(),
        "decided_at": request.decided_at.isoformat() if request.decided_at else None,
        "refund": None
        if refund is None
        else {
            "state": refund.state,
            "method": refund.method,
            "amount": str(refund.amount),
            "destination": refund.payer,
            "paid_at": refund.paid_at.isoformat() if refund.paid_at else None,
            "reference": refund.paid_reference or None,
        },
        "refund_receipt": refund_receipt(request=request, refund=refund)
        if status == "executed" and refund is not None
        else None,
        "links": {
            "self": reverse(
                "api:refund-request-detail",
                kwargs={"ref": purchase_ref, "public_id": request.public_id},
            ),
            "purchase": reverse("api:purchase-detail", kwargs={"ref": purchase_ref}),
        },
    }


def refund_receipt(*, request: RefundRequest, refund: Refund) -> dict[str, Any]:
    """The signed refund receipt of an executed request (fulfillment.refund_receipt_signing):
    the same bytes at every read, so it is signed when asked for."""
    paid_at = refund.paid_at or refund.created_at
    payload = {
        "version": REFUND_RECEIPT_VERSION,
        "purchase": request.purchase.ref,
        "refundRequest": request.public_id,
        "network": refund.network,
        "asset": refund.asset,
        "amount": str(refund.amount),
        "payer": refund.payer,
        "method": refund.method,
        "transaction": refund.payback_tx_hash or refund.paid_reference,
        "issuedAt": int(paid_at.timestamp()),
    }
    return refund_receipt_sign(payload=payload, key=signing_key())


def refund_request_get(*, ref: str, public_id: str, buyer: Buyer | None) -> RefundRequest:
    """A buyer's request by its purchase and id. With an API key, only that buyer's
    purchases; without one (the wallet path), the unguessable request id is the capability,
    as a purchase's capability URL is. Raises DomainError: refund_request_not_found."""
    requests = RefundRequest.objects.select_related("purchase", "refund").filter(
        public_id=public_id, purchase__ref=ref
    )
    if buyer is not None:
        requests = requests.filter(purchase__buyer=buyer)
    request = requests.first()
    if request is None:
        raise DomainError(ErrorCode.REFUND_REQUEST_NOT_FOUND)
    return request


def refund_request_latest(*, purchase: Purchase) -> RefundRequest | None:
    return (
        RefundRequest.objects.select_related("purchase", "refund")
        .filter(purchase=purchase)
        .order_by("-pk")
        .first()
    )


def refund_request_facts(*, request: RefundRequest) -> list[tuple[str, str]]:
    """The case's facts support weighs a request against, in words, beside it in the queue:
    what was paid and by whom, whether the work ran and its result was delivered, what was
    refunded already and what is left, open escalations."""
    purchase = request.purchase
    attempt = (
        PaymentAttempt.objects.filter(purchase_id=purchase.pk, state=PaymentAttempt.State.SUCCEEDED)
        .order_by("pk")
        .first()
    )
    refunds = Refund.objects.filter(purchase_id=purchase.pk).order_by("pk")
    counted = sum(r.amount for r in refunds if r.state != Refund.State.DECLINED)
    result = fulfillment_selectors.result_for_purchase(purchase_id=purchase.pk)
    escalations = purchase.escalations.filter(state="open").order_by("pk")
    delivered = (
        f"first delivered {utc_seconds(result.first_delivered_at)}"
        if result is not None and result.first_delivered_at
        else ("stored, never delivered" if result is not None else "no stored result")
    )
    return [
        ("Purchase", f"{purchase.ref} ({purchase.offering.slug}, {purchase.channel})"),
        ("Payment", f"{purchase.payment_state}; {purchase.amount} {purchase.asset}"),
        ("Paid by", attempt.payer if attempt else "no settled payment"),
        ("Transaction", (attempt.tx_hash or attempt.settlement_reference) if attempt else "-"),
        ("Work", f"{purchase.fulfillment_state}; result {delivered}"),
        (
            "Refunded so far",
            "; ".join(f"{r.amount} {r.state} ({r.reason_code})" for r in refunds) or "nothing",
        ),
        ("Left to refund", str(attempt.amount - counted) if attempt else "0"),
        (
            "Open escalations",
            "; ".join(f"{e.reason_code} (owner {e.owner})" for e in escalations) or "none",
        ),
        ("Buyer's reason", request.reason or "(none given)"),
    ]
