"""Payment writes: the prepaid ledger, payment attempts and refunds.

Everything here runs inside a transaction opened by the purchases orchestration, which has
already locked the purchase row (and, for the ledger, the buyer row); these functions lock
only what they own. They take ids and plain values and return what changed
(core.changes.Change) for the orchestration to put on the purchase's timeline.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import F, Sum

from core.changes import Change
from core.errors import DomainError, ErrorCode
from payments.models import (
    LIVE_ATTEMPT_STATES,
    ExportBatch,
    LedgerBalance,
    LedgerEntry,
    PaymentAttempt,
    Rail,
    Refund,
)

PREPAID_NETWORK = "prepaid"


def ledger_balance(*, buyer_id: int, asset: str) -> int:
    """The running balance (one row), never a SUM over the buyer's history."""
    amount = (
        LedgerBalance.objects.filter(buyer_id=buyer_id, asset=asset)
        .values_list("amount", flat=True)
        .first()
    )
    return int(amount or 0)


def _balance_add(*, buyer_id: int, asset: str, amount: int) -> None:
    """Move the running balance with its entry, in the entry's transaction."""
    LedgerBalance.objects.bulk_create(
        [LedgerBalance(buyer_id=buyer_id, asset=asset, amount=0)], ignore_conflicts=True
    )
    LedgerBalance.objects.filter(buyer_id=buyer_id, asset=asset).update(amount=F("amount") + amount)


class LedgerReferenceConflict(ValueError):
    """The reference already posted a different entry: refuse rather than pretend to credit."""


def ledger_credit(
    *,
    buyer_id: int,
    asset: str,
    amount: int,
    kind: str,
    reference: str,
    memo: str = "",
    purchase_id: int | None = None,
) -> LedgerEntry:
    """Post a credit once per reference: a retried top-up returns the first entry.

    Raises LedgerReferenceConflict when the reference already holds a different entry.
    """
    if amount <= 0:
        raise ValueError("credits are positive")
    with transaction.atomic():
        entry, created = LedgerEntry.objects.get_or_create(
            reference=reference,
            defaults={
                "buyer_id": buyer_id,
                "asset": asset,
                "amount": amount,
                "kind": kind,
                "memo": memo,
                "purchase_id": purchase_id,
            },
        )
        if created:
            _balance_add(buyer_id=buyer_id, asset=asset, amount=amount)
    if (entry.buyer_id, entry.asset, entry.amount, entry.kind) != (buyer_id, asset, amount, kind):
        raise LedgerReferenceConflict(f"reference {reference} already posted a different entry")
    return entry


def spend_in_window(*, buyer_id: int, since: datetime) -> int:
    """What a buyer's purchases paid or are paying since `since`, on every rail."""
    total = PaymentAttempt.objects.filter(
        purchase__buyer_id=buyer_id, state__in=LIVE_ATTEMPT_STATES, created_at__gte=since
    ).aggregate(total=Sum("amount"))["total"]
    return int(total or 0)


@dataclass(frozen=True)
class PrepaidCharge:
    purchase_id: int
    purchase_ref: str
    buyer_id: int
    buyer_ref: str
    amount: int
    asset: str
    idempotency_record_id: int
    fingerprint: str


def prepaid_attempt_settle(*, charge: PrepaidCharge) -> tuple[PaymentAttempt, Change]:
    """Debit the ledger and record a succeeded prepaid attempt, atomically.

    One conditional UPDATE of the running balance locks, checks and debits at once: two
    debits of one buyer never interleave and never overdraw. Raises DomainError:
    insufficient_funds.
    """
    assert transaction.get_connection().in_atomic_block
    debited = LedgerBalance.objects.filter(
        buyer_id=charge.buyer_id, asset=charge.asset, amount__gte=charge.amount
    ).update(amount=F("amount") - charge.amount)
    if not debited:
        raise DomainError(ErrorCode.INSUFFICIENT_FUNDS)
    attempt = PaymentAttempt.objects.create(
        purchase_id=charge.purchase_id,
        rail=Rail.PREPAID,
        idempotency_record_id=charge.idempotency_record_id,
        payer=charge.buyer_ref,
        network=PREPAID_NETWORK,
        asset=charge.asset,
        amount=charge.amount,
        fingerprint=charge.fingerprint,
    )
    entry = LedgerEntry.objects.create(
        buyer_id=charge.buyer_id,
        asset=charge.asset,
        amount=-charge.amount,
        kind=LedgerEntry.Kind.PURCHASE_DEBIT,
        reference=f"debit:{charge.purchase_ref}:{attempt.pk}",
        purchase_id=charge.purchase_id,
    )
    attempt.succeed(settlement_reference=entry.reference)
    attempt.save(update_fields=["state", "settlement_reference", "updated_at"])
    change = Change(
        subject="payment_attempt",
        from_state=PaymentAttempt.State.RECORDED,
        to_state=attempt.state,
        evidence={
            "attempt": attempt.pk,
            "rail": attempt.rail,
            "ledger_entry": entry.reference,
            "amount": str(attempt.amount),
        },
    )
    return attempt, change


def payment_attempt_settled(*, purchase_id: int) -> PaymentAttempt | None:
    return (
        PaymentAttempt.objects.filter(purchase_id=purchase_id, state=PaymentAttempt.State.SUCCEEDED)
        .order_by("pk")
        .first()
    )


def payment_attempt_live(*, purchase_id: int) -> PaymentAttempt | None:
    return (
        PaymentAttempt.objects.filter(purchase_id=purchase_id, state__in=LIVE_ATTEMPT_STATES)
        .order_by("-pk")
        .first()
    )


def refund_create(
    *,
    attempt: PaymentAttempt,
    buyer_id: int | None,
    reason_code: str,
    paid_by: str,
    now: datetime,
    tx_hash: str | None = None,
) -> tuple[Refund, list[Change]]:
    """A refund linked to the purchase and the payment it returns.

    Prepaid money goes straight back to the balance (the refund is paid at once); on-chain
    money becomes a refund-owed record that finance pays back and marks paid. Idempotent per
    (payment, reason): a second call returns the first refund and no changes.
    """
    existing = Refund.objects.filter(payment_attempt=attempt, reason_code=reason_code).first()
    if existing:
        return existing, []
    is_prepaid = attempt.rail == Rail.PREPAID
    refund = Refund.objects.create(
        purchase_id=attempt.purchase_id,
        payment_attempt=attempt,
        method=Refund.Method.LEDGER_CREDIT if is_prepaid else Refund.Method.PAY_BACK,
        amount=attempt.amount,
        asset=attempt.asset,
        network=attempt.network,
        payer=attempt.payer,
        reason_code=reason_code,
        transaction=tx_hash or attempt.tx_hash or "",
    )
    changes = [
        Change(
            subject="refund",
            to_state=refund.state,
            reason_code=reason_code,
            evidence={"refund": refund.pk, "method": refund.method, "amount": str(refund.amount)},
        )
    ]
    if is_prepaid and buyer_id is not None:
        entry = ledger_credit(
            buyer_id=buyer_id,
            asset=attempt.asset,
            amount=attempt.amount,
            kind=LedgerEntry.Kind.REFUND_CREDIT,
            reference=f"refund:{refund.pk}",
            purchase_id=attempt.purchase_id,
            memo=reason_code,
        )
        refund, paid = refund_mark_paid(
            refund_id=refund.pk, reference=entry.reference, by=paid_by, now=now
        )
        changes.extend([paid] if paid else [])
    return refund, changes


def refund_mark_paid(
    *, refund_id: int, reference: str, by: str, now: datetime
) -> tuple[Refund, Change | None]:
    """Close a refund with the reference of the money sent back.

    Idempotent for the same reference (no change the second time); raises ValueError for an
    empty reference or one that differs from the reference the refund was closed with, and
    RefundReferenceInvalid (a ValueError) for a reference that does not fit the refund's rail
    (see refund_reference_problem).
    """
    if not reference.strip():
        raise ValueError("a paid-back refund needs the reference of the payment")
    with transaction.atomic():
        refund = Refund.objects.select_for_update().get(pk=refund_id)
        if refund.state == Refund.State.PAID:
            if refund.paid_reference != reference:
                raise ValueError(
                    f"refund {refund.pk} was already paid back as {refund.paid_reference}"
                )
            return refund, None
        problem = refund_reference_problem(refund=refund, reference=reference)
        if problem:
            raise RefundReferenceInvalid(problem)
        refund.mark_paid(reference=reference, by=by, at=now)
        refund.save(update_fields=["state", "paid_reference", "paid_by", "paid_at"])
    change = Change(
        subject="refund",
        from_state=Refund.State.OWED,
        to_state=refund.state,
        evidence={"refund": refund.pk, "reference": reference},
    )
    return refund, change


class RefundReferenceInvalid(ValueError):
    """The pay-back reference does not prove this refund was paid on its rail."""


TX_HASH_PATTERN = re.compile(r"0x[0-9a-fA-F]{64}")


def refund_reference_problem(*, refund: Refund, reference: str) -> str | None:
    """Why `reference` cannot close `refund`, or None when it can.

    On chain (pay back) it is the payback's transaction hash: 0x and 32 bytes of hex. On the
    prepaid rail (ledger credit) it is the reference of the ledger entry that credited the
    money back: an existing credit to the purchase's buyer, in the refund's asset, of exactly
    the refund's amount, not already closing another refund.
    """
    if refund.method == Refund.Method.PAY_BACK:
        if TX_HASH_PATTERN.fullmatch(reference):
            return None
        return "A chain refund is closed by its payback's transaction hash (0x + 64 hex)."
    credit = LedgerEntry.objects.filter(
        reference=reference, buyer__purchases=refund.purchase_id, asset=refund.asset
    ).first()
    if credit is None or credit.amount <= 0:
        return "No ledger credit with this reference for this buyer and asset."
    if credit.amount != refund.amount:
        return f"That ledger credit is {credit.amount}, the refund {refund.amount} (atomic)."
    taken = Refund.objects.filter(method=refund.method, paid_reference=reference)
    if taken.exclude(pk=refund.pk).exists():
        return "That ledger credit already closes another refund."
    return None


def export_batch_record(
    *,
    kind: str,
    created_by: str,
    filters: dict[str, Any],
    row_count: int,
    sha256: str,
    started_at: datetime,
    first_created_at: datetime | None,
    last_created_at: datetime | None,
) -> ExportBatch:
    """Record one finished export (called when its stream ended), so a re-export compares."""
    return ExportBatch.objects.create(
        kind=kind,
        created_by=created_by,
        filters=filters,
        row_count=row_count,
        sha256=sha256,
        started_at=started_at,
        first_created_at=first_created_at,
        last_created_at=last_created_at,
    )


@dataclass(frozen=True)
class BalanceMismatch:
    buyer_id: int
    asset: str
    running: int
    from_entries: int


def ledger_balances_mismatched() -> list[BalanceMismatch]:
    """Every running balance that differs from the sum of its entries (should be none)."""
    sums = {
        (row["buyer_id"], row["asset"]): int(row["total"] or 0)
        for row in LedgerEntry.objects.values("buyer_id", "asset").annotate(total=Sum("amount"))
    }
    running = {
        (row["buyer_id"], row["asset"]): row["amount"]
        for row in LedgerBalance.objects.values("buyer_id", "asset", "amount")
    }
    return [
        BalanceMismatch(buyer_id, asset, running.get((buyer_id, asset), 0), total)
        for (buyer_id, asset), total in sorted({**dict.fromkeys(running, 0), **sums}.items())
        if running.get((buyer_id, asset), 0) != total
    ]
