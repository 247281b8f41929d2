"""Payment writes: the prepaid ledger, payment attempts and refunds.

Everything here runs inside a transaction opened by the purchases orchestration, which
has already locked the purchase row; these functions lock only what they own.
"""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.db.models import Sum

from core.actors import Actor
from core.errors import DomainError, ErrorCode
from payments.models import LIVE_ATTEMPT_STATES, LedgerEntry, PaymentAttempt, Refund
from purchases.events import event_record
from purchases.models import Buyer, Purchase

PREPAID_NETWORK = "prepaid"


def ledger_balance(*, buyer: Buyer, asset: str) -> int:
    total = LedgerEntry.objects.filter(buyer=buyer, asset=asset).aggregate(total=Sum("amount"))[
        "total"
    ]
    return int(total or 0)


class LedgerReferenceConflict(ValueError):
    """The reference already posted a different entry: refuse rather than pretend to credit."""


def ledger_credit(
    *,
    buyer: Buyer,
    asset: str,
    amount: int,
    kind: str,
    reference: str,
    memo: str = "",
    purchase: Purchase | None = None,
) -> LedgerEntry:
    """Post a credit once per reference: a retried top-up returns the first entry.

    Raises LedgerReferenceConflict when the reference already holds a different entry.
    """
    if amount <= 0:
        raise ValueError("credits are positive")
    entry, _ = LedgerEntry.objects.get_or_create(
        reference=reference,
        defaults={
            "buyer": buyer,
            "asset": asset,
            "amount": amount,
            "kind": kind,
            "memo": memo,
            "purchase": purchase,
        },
    )
    if (entry.buyer_id, entry.asset, entry.amount, entry.kind) != (buyer.pk, asset, amount, kind):
        raise LedgerReferenceConflict(f"reference {reference} already posted a different entry")
    return entry


def spend_in_window(*, buyer: Buyer, now: datetime) -> int:
    since = now - settings.TOLLBOOTH["SPEND_CAP_WINDOW"]
    total = PaymentAttempt.objects.filter(
        purchase__buyer=buyer, state__in=LIVE_ATTEMPT_STATES, created_at__gte=since
    ).aggregate(total=Sum("amount"))["total"]
    return int(total or 0)


def spend_cap_check(
    *, buyer: Buyer, amount: int, now: datetime, purchase_ref: str | None = None
) -> None:
    """Lock the buyer row and refuse a payment past its cap, on any rail.

    The buyer row is also the ledger's lock: two debits of one buyer never interleave.
    Raises DomainError: spend_cap_exceeded.
    """
    Buyer.objects.select_for_update().get(pk=buyer.pk)
    if (
        buyer.spend_cap is not None
        and spend_in_window(buyer=buyer, now=now) + amount > buyer.spend_cap
    ):
        raise DomainError(ErrorCode.SPEND_CAP_EXCEEDED, purchase=purchase_ref)


def prepaid_attempt_settle(
    *,
    purchase: Purchase,
    buyer: Buyer,
    payment_id: str,
    scope: str,
    fingerprint: str,
    now: datetime,
    actor: Actor,
) -> PaymentAttempt:
    """Debit the ledger and record a succeeded prepaid attempt, atomically.

    Raises DomainError: spend_cap_exceeded, insufficient_funds.
    """
    assert transaction.get_connection().in_atomic_block
    spend_cap_check(buyer=buyer, amount=purchase.amount, now=now, purchase_ref=purchase.ref)
    if ledger_balance(buyer=buyer, asset=purchase.asset) < purchase.amount:
        raise DomainError(ErrorCode.INSUFFICIENT_FUNDS, purchase=purchase.ref)
    attempt = PaymentAttempt.objects.create(
        purchase=purchase,
        rail=Purchase.Rail.PREPAID,
        scope=scope,
        payment_id=payment_id,
        payer=buyer.ref,
        network=PREPAID_NETWORK,
        asset=purchase.asset,
        amount=purchase.amount,
        fingerprint=fingerprint,
    )
    entry = LedgerEntry.objects.create(
        buyer=buyer,
        asset=purchase.asset,
        amount=-purchase.amount,
        kind=LedgerEntry.Kind.PURCHASE_DEBIT,
        reference=f"debit:{purchase.ref}:{attempt.pk}",
        purchase=purchase,
    )
    attempt.succeed(settlement_reference=entry.reference)
    attempt.save(update_fields=["state", "settlement_reference", "updated_at"])
    event_record(
        subject="payment_attempt",
        purchase=purchase,
        actor=actor,
        from_state=PaymentAttempt.State.RECORDED,
        to_state=attempt.state,
        evidence={
            "attempt": attempt.pk,
            "rail": attempt.rail,
            "ledger_entry": entry.reference,
            "amount": str(attempt.amount),
        },
    )
    return attempt


def payment_attempt_settled(*, purchase: Purchase) -> PaymentAttempt | None:
    return (
        purchase.payment_attempts.filter(state=PaymentAttempt.State.SUCCEEDED)
        .order_by("pk")
        .first()
    )


def payment_attempt_live(*, purchase: Purchase) -> PaymentAttempt | None:
    return purchase.payment_attempts.filter(state__in=LIVE_ATTEMPT_STATES).order_by("-pk").first()


def refund_create(
    *,
    purchase: Purchase,
    attempt: PaymentAttempt,
    reason_code: str,
    now: datetime,
    actor: Actor,
    tx_hash: str | None = None,
) -> Refund:
    """A refund linked to the purchase and the payment it returns.

    Prepaid money goes straight back to the balance (the refund is paid at once); on-chain
    money becomes a refund-owed record that finance pays back and marks paid.
    """
    existing = Refund.objects.filter(payment_attempt=attempt, reason_code=reason_code).first()
    if existing:
        return existing
    is_prepaid = attempt.rail == Purchase.Rail.PREPAID
    refund = Refund.objects.create(
        purchase=purchase,
        payment_attempt=attempt,
        method=Refund.Method.LEDGER_CREDIT if is_prepaid else Refund.Method.PAY_BACK,
        amount=attempt.amount,
        asset=attempt.asset,
        network=attempt.network,
        payer=attempt.payer,
        reason_code=reason_code,
        transaction=tx_hash or attempt.tx_hash or "",
    )
    event_record(
        subject="refund",
        purchase=purchase,
        actor=actor,
        to_state=refund.state,
        reason_code=reason_code,
        evidence={"refund": refund.pk, "method": refund.method, "amount": str(refund.amount)},
    )
    if is_prepaid and purchase.buyer is not None:
        entry = ledger_credit(
            buyer=purchase.buyer,
            asset=attempt.asset,
            amount=attempt.amount,
            kind=LedgerEntry.Kind.REFUND_CREDIT,
            reference=f"refund:{refund.pk}",
            purchase=purchase,
            memo=reason_code,
        )
        refund_mark_paid(
            refund=refund,
            reference=entry.reference,
            by=actor.name or actor.type,
            now=now,
            actor=actor,
        )
    return refund


def refund_mark_paid(
    *, refund: Refund, reference: str, by: str, now: datetime, actor: Actor
) -> Refund:
    """Close a refund with the reference of the money sent back.

    Idempotent for the same reference; raises ValueError for an empty reference or one
    that differs from the reference the refund was already closed with.
    """
    if not reference.strip():
        raise ValueError("a paid-back refund needs the reference of the payment")
    with transaction.atomic():
        refund = Refund.objects.select_for_update().select_related("purchase").get(pk=refund.pk)
        if refund.state == Refund.State.PAID:
            if refund.paid_reference != reference:
                raise ValueError(
                    f"refund {refund.pk} was already paid back as {refund.paid_reference}"
                )
            return refund
        refund.mark_paid(reference=reference, by=by, at=now)
        refund.save(update_fields=["state", "paid_reference", "paid_by", "paid_at"])
        event_record(
            subject="refund",
            purchase=refund.purchase,
            actor=actor,
            from_state=Refund.State.OWED,
            to_state=refund.state,
            evidence={"refund": refund.pk, "reference": reference},
        )
    return refund
