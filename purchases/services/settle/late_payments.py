"""Money that lands when it should not: after the purchase failed, or twice for one purchase.

The original outcome is never rewritten. A late transfer becomes a refund-owed record
linked to the purchase and the transaction (or, if the offering fulfils late payments and
its stock is still free, the purchase is paid after all). A second settlement of a paid
purchase is always a refund. Either way people are alerted after commit.
"""

from __future__ import annotations

from datetime import datetime

from core.actors import Actor
from payments.models import PaymentAttempt, Refund
from purchases.events import event_record, purchase_transition
from purchases.models import Offering, Purchase, PurchaseEvent
from purchases.services.quote.offerings import offering_stock_take
from purchases.services.remedy.remedies import purchase_refund_create

PAY = Purchase.PaymentState
LATE = "late_settlement"
DUPLICATE = "duplicate_settlement"


def settlement_unexpected(
    *, purchase: Purchase, attempt: PaymentAttempt, tx_hash: str, now: datetime, actor: Actor
) -> Refund | None:
    """Handle a proven transfer to us that the purchase's state did not expect.

    Caller holds the purchase lock. Returns the refund owed, or None if the late payment
    was accepted (policy fulfil, stock still free).
    """
    handled = PurchaseEvent.objects.filter(
        purchase=purchase, reason_code__in=[LATE, DUPLICATE], evidence__attempt=attempt.pk
    )
    if handled.exists():
        return None  # this transfer was already refunded or accepted: say nothing twice
    reason = DUPLICATE if purchase.payment_state == PAY.PAID else LATE
    event_record(
        subject="purchase.payment",
        purchase=purchase,
        actor=actor,
        from_state=purchase.payment_state,
        to_state=purchase.payment_state,
        reason_code=reason,
        evidence={"attempt": attempt.pk, "tx_hash": tx_hash, "amount": str(attempt.amount)},
    )
    is_recoverable = purchase.payment_state in (PAY.FAILED, PAY.VOID)
    if reason == LATE and is_recoverable and _fulfils_late_payments(purchase):
        purchase_transition(
            purchase=purchase,
            transition=purchase.payment_recover,
            actor=actor,
            arguments={"paid_at": now},
            update_fields=["paid_at", "reason_code"],
        )
        return None
    # Owed: its alert is staged with it (purchase_refund_create).
    return purchase_refund_create(
        purchase=purchase,
        attempt=attempt,
        reason_code=reason,
        now=now,
        actor=actor,
        tx_hash=tx_hash,
    )


def _fulfils_late_payments(purchase: Purchase) -> bool:
    """Fulfil only if the offering says so and the unit is still ours or still free."""
    if purchase.offering.late_payment_policy != Offering.LatePaymentPolicy.FULFIL:
        return False
    quote = purchase.quote
    if quote.holds_stock or purchase.offering.stock is None:
        return True
    # The released unit is never silently resurrected: take one only if one is free now.
    taken = offering_stock_take(offering_id=purchase.offering_id)
    if taken:
        quote.holds_stock = True
        quote.save(update_fields=["holds_stock"])
    return bool(taken)
