"""Signed receipts: issued once the payment is final, then the same bytes on every paid
answer, for ever (docs/receipts.md).

A prepaid payment is final when its debit commits, so its receipt is signed with the result
(fulfillment.services.receipt_sign_into). An x402 settlement is final per its network's
finality policy (payments.rails.x402.finality): until then a paid answer carries no receipt; the
first answer after it (a resent payment, the status URL, a re-signed retry, a fetch of the
result) or the finality watch issues it. The settlement time is the block's timestamp,
read from the chain once and kept on the attempt.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.conf import settings
from django.urls import reverse

from core.actors import Actor
from core.clock import now_or
from fulfillment import selectors as fulfillment_selectors
from fulfillment import services as fulfillment_services
from fulfillment.models import Receipt
from fulfillment.services import ReceiptFacts
from payments.models import PaymentAttempt, Rail
from payments.rails.x402.books_evidence import settlement_block_record
from payments.rails.x402.chain import ChainUnavailable
from purchases import event_subjects as subjects
from purchases.events import event_note
from purchases.models import Purchase

PAY = Purchase.PaymentState


def receipt_resource_url(*, offering_slug: str) -> str:
    """The paid resource a receipt names (the draft's `resourceUrl`): the offering's paid
    URL under TOLLBOOTH_PUBLIC_URL, whichever door it was bought through."""
    path = reverse("x402-paid", kwargs={"offering": offering_slug})
    return str(settings.TOLLBOOTH_PUBLIC_URL) + path


def receipt_facts(
    *, purchase: Purchase, attempt: PaymentAttempt | None, settled_at: datetime | None = None
) -> ReceiptFacts | None:
    """What a receipt states beyond its row, if the payment is final now; None while it is
    not (no receipt yet). No I/O: an x402 settlement's block time must be known already
    (`settled_at`, or the attempt's `block_at`)."""
    if purchase.payment_state != PAY.PAID:
        return None
    if purchase.rail == Rail.PREPAID:
        settled_at = purchase.paid_at
    elif not is_final(attempt):
        return None
    else:
        assert attempt is not None
        settled_at = settled_at or attempt.block_at
    if settled_at is None:
        return None
    slug = purchase.offering.slug
    return ReceiptFacts(
        purchase_ref=purchase.ref,
        offering=slug,
        resource_url=receipt_resource_url(offering_slug=slug),
        settled_at=settled_at,
    )


def is_final(attempt: PaymentAttempt | None) -> bool:
    """An x402 settlement past its network's finality policy (`final_at` recorded)."""
    return (
        attempt is not None
        and attempt.state == PaymentAttempt.State.SUCCEEDED
        and attempt.final_at is not None
    )


def purchase_receipt_issue(
    *,
    purchase: Purchase,
    attempt: PaymentAttempt | None = None,
    receipt: Receipt | None = None,
    now: datetime | None = None,
) -> str:
    """The purchase's signed receipt (its JSON text): the stored one, or issued now if the
    payment is final; "" while it is not, or before the result exists.

    May read the block's timestamp from the chain (once per settlement): call it with no
    transaction open. A chain that does not answer leaves the receipt for a later answer.
    """
    receipt = receipt or fulfillment_selectors.receipt_for_purchase(purchase_id=purchase.pk)
    if receipt is None:
        return ""
    if receipt.signed:
        return receipt.signed
    if purchase.rail != Rail.PREPAID:
        attempt = attempt if is_final(attempt) else _settled_attempt(purchase)
    settled_at = settlement_mined_at(attempt=attempt) if purchase.rail != Rail.PREPAID else None
    facts = receipt_facts(purchase=purchase, attempt=attempt, settled_at=settled_at)
    if facts is None:
        return ""
    now = now_or(now)
    signed = fulfillment_services.receipt_issue(receipt=receipt, facts=facts, now=now)
    if receipt.issued_at == now:  # this call issued it, not a racing one
        event_note(
            subject=subjects.RECEIPT_ISSUED,
            purchase=purchase,
            actor=Actor.system("receipts"),
            evidence={"receipt": receipt.public_id, "key_id": receipt.key_id},
        )
    return signed


def _settled_attempt(purchase: Purchase) -> PaymentAttempt | None:
    return (
        PaymentAttempt.objects.filter(purchase_id=purchase.pk, state=PaymentAttempt.State.SUCCEEDED)
        .order_by("-pk")
        .first()
    )


def settlement_mined_at(*, attempt: PaymentAttempt | None) -> datetime | None:
    """A final settlement's block time: recorded, or read from the chain now with the rest of
    what its block tells the books, and recorded (None if the chain does not answer). No
    transaction may be open."""
    if not is_final(attempt):
        return None
    assert attempt is not None
    if attempt.block_at is not None:
        return attempt.block_at
    try:
        return settlement_block_record(attempt=attempt)
    except ChainUnavailable:
        return None


def receipt_document(signed: str) -> dict[str, Any]:
    """The signed receipt as a JSON object (for a problem body or MCP `_meta`)."""
    document: dict[str, Any] = json.loads(signed)
    return document


def signed_receipt_extra(signed: str) -> dict[str, Any]:
    """A refusal's `signed_receipt` member: the API renders it as the receipt header too."""
    return {"signed_receipt": receipt_document(signed)} if signed else {}
