"""Payment writes: the prepaid ledger, payment attempts and refunds.

Everything here runs inside a transaction opened by the purchases orchestration, which has
already locked the purchase row (and, for the ledger, the buyer row); these functions lock
only what they own. They take ids and plain values and return what changed
(core.changes.Change) for the orchestration to put on the purchase's timeline.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import transaction
from django.db.models import F, Sum
from django.utils import timezone

from core.changes import Change
from core.clock import now_or
from core.locks import lock_rows
from payments import sql
from payments.models import (
    LIVE_ATTEMPT_STATES,
    ExportBatch,
    LedgerBalance,
    LedgerEntry,
    PaymentAttempt,
    Rail,
    Refund,
)
from payments.rails.base import FACILITATOR_PAYMENT_ID, SettlementOutcome, SettlementStatus

# The paying account (purchases.Buyer), reached through the ledger's own foreign key: this
# app never imports purchases.
_ACCOUNTS = LedgerBalance._meta.get_field("buyer").related_model._default_manager  # type: ignore[union-attr]


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


# The debit and its entry in one statement: the entry is written only if the conditional
# UPDATE of the running balance (which locks, checks and debits at once) moved it.
def ledger_debit(
    *, buyer_id: int, asset: str, amount: int, reference: str, purchase_id: int
) -> LedgerEntry | None:
    """Debit the running balance and post the purchase's debit entry, or neither: None when
    the balance is short. One statement on PostgreSQL; two elsewhere (the balance UPDATE
    still decides). Caller's transaction."""
    assert transaction.get_connection().in_atomic_block
    entry = LedgerEntry(
        buyer_id=buyer_id,
        asset=asset,
        amount=-amount,
        kind=LedgerEntry.Kind.PURCHASE_DEBIT,
        reference=reference,
        purchase_id=purchase_id,
        created_at=timezone.now(),
    )
    return entry if sql.ledger_debit_post(entry=entry, amount=amount) else None


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
    """Post a credit once per reference: a retried top-up returns the first entry. Locks the
    buyer row, then its balance (core.locks).

    Raises LedgerReferenceConflict when the reference already holds a different entry.
    """
    entry, _posted = ledger_credit_once(
        buyer_id=buyer_id,
        asset=asset,
        amount=amount,
        kind=kind,
        reference=reference,
        memo=memo,
        purchase_id=purchase_id,
    )
    return entry


def ledger_credit_once(
    *,
    buyer_id: int,
    asset: str,
    amount: int,
    kind: str,
    reference: str,
    memo: str = "",
    purchase_id: int | None = None,
) -> tuple[LedgerEntry, bool]:
    """ledger_credit, saying whether this call posted the entry (False: the reference already
    had it, as a retried top-up finds it). Raises LedgerReferenceConflict as ledger_credit."""
    if amount <= 0:
        raise ValueError("credits are positive")
    with transaction.atomic():
        # The account before its balance (core.locks' order), as a capped payment takes them:
        # a credit and a payment of one buyer then queue on the buyer row, never in a cycle.
        lock_rows(_ACCOUNTS.filter(pk=buyer_id))
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
    return entry, created


def spend_in_window(*, buyer_id: int, since: datetime) -> int:
    """What a buyer's purchases paid or are paying since `since`, on every rail."""
    total = PaymentAttempt.objects.filter(
        purchase__buyer_id=buyer_id, state__in=LIVE_ATTEMPT_STATES, created_at__gte=since
    ).aggregate(total=Sum("amount"))["total"]
    return int(total or 0)


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


class RefundExceedsSettled(ValueError):
    """The refunds of a payment (proposed, owed or paid) would add up to more than it
    settled."""


# Declined proposals return nothing; every other refund counts against the payment.
_COUNTED_REFUND_STATES = (Refund.State.PROPOSED, Refund.State.OWED, Refund.State.PAID)


def refund_refundable(*, attempt_id: int) -> tuple[int, int]:
    """(settled, still refundable) of a payment, in atomic units: what it settled less its
    refunds proposed, owed or paid. Exact only under the payment's row lock (refund_propose,
    refund_record take it)."""
    settled = PaymentAttempt.objects.values_list("amount", flat=True).get(pk=attempt_id)
    counted = Refund.objects.filter(
        payment_attempt_id=attempt_id, state__in=_COUNTED_REFUND_STATES
    ).aggregate(total=Sum("amount"))["total"]
    return int(settled), int(settled) - int(counted or 0)


def _lock_payment(attempt: PaymentAttempt) -> None:
    # The payment's row serializes its refunds: two proposals racing cannot both read the
    # same room left (core.locks' order: the purchase, then its attempts).
    lock_rows(PaymentAttempt.objects.filter(pk=attempt.pk))


def refund_record(
    *, attempt: PaymentAttempt, method: str, reason_code: str, tx_hash: str | None = None
) -> tuple[Refund, list[Change]]:
    """A refund linked to the purchase and the payment it returns; the rail decides how the
    money goes back (payments.rails). Idempotent per (payment, reason): a second call
    returns the first refund and no changes. It returns what is still refundable (all of it
    unless staff refunds came first).

    Raises RefundExceedsSettled when the payment was refunded in full already."""
    existing = Refund.objects.filter(
        payment_attempt=attempt, reason_code=reason_code, proposed_by=""
    ).first()
    if existing:
        return existing, []
    with transaction.atomic():
        _lock_payment(attempt)
        _settled, refundable = refund_refundable(attempt_id=attempt.pk)
        if refundable <= 0:
            raise RefundExceedsSettled(f"payment {attempt.pk} was refunded in full already")
        return _refund_record_locked(attempt, method, reason_code, tx_hash, refundable)


def _refund_record_locked(
    attempt: PaymentAttempt, method: str, reason_code: str, tx_hash: str | None, amount: int
) -> tuple[Refund, list[Change]]:
    refund = Refund.objects.create(
        purchase_id=attempt.purchase_id,
        payment_attempt=attempt,
        method=method,
        amount=amount,
        asset=attempt.asset,
        network=attempt.network,
        payer=attempt.payer,
        reason_code=reason_code,
        transaction=tx_hash or attempt.tx_hash or "",
    )
    change = Change(
        subject="refund",
        to_state=refund.state,
        reason_code=reason_code,
        evidence={"refund": refund.pk, "method": refund.method, "amount": str(refund.amount)},
    )
    return refund, [change]


def refund_mark_paid(
    *, refund_id: int, reference: str, by: str, now: datetime
) -> tuple[Refund, Change | None]:
    """Close a refund with the reference of the money sent back.

    Ledger credits only: a chain refund closes on chain evidence (payments.paybacks).
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
        if refund.method == Refund.Method.PAY_BACK:
            # A hash proves nothing by its shape: the chain judges it (payments.paybacks).
            raise RefundReferenceInvalid("A chain refund is closed on chain evidence only.")
        refund.mark_paid(reference=reference, by=by, at=now)
        refund.save(update_fields=["state", "paid_reference", "paid_by", "paid_at"])
    change = Change(
        subject="refund",
        from_state=Refund.State.OWED,
        to_state=refund.state,
        evidence={"refund": refund.pk, "reference": reference},
    )
    return refund, change


def refund_propose(
    *,
    attempt: PaymentAttempt,
    amount: int,
    reason_code: str,
    proposed_by: str,
    note: str,
) -> tuple[Refund, Change | None]:
    """A staff proposal to return money (all that is left of the payment, or part of it).
    Several may be made against one payment, never adding up (with its other refunds
    proposed, owed or paid) to more than it settled: checked under the payment's row lock.

    Nothing is owed and nothing is credited until finance approves (`refund_decide`).
    Idempotent per (payment, reason) while a proposal is open: a second proposal returns
    it and no change. Raises ValueError for an amount below 1, RefundExceedsSettled (a
    ValueError) for one above what is still refundable.
    """
    if amount <= 0:
        raise ValueError("the amount must be at least 1 atomic unit")
    with transaction.atomic():
        _lock_payment(attempt)
        existing = Refund.objects.filter(
            payment_attempt=attempt, reason_code=reason_code, state=Refund.State.PROPOSED
        ).first()
        if existing:
            return existing, None
        settled, refundable = refund_refundable(attempt_id=attempt.pk)
        if amount > refundable:
            raise RefundExceedsSettled(
                f"only {refundable} of the {settled} atomic units settled are still refundable"
            )
        return _refund_propose_locked(attempt, amount, reason_code, proposed_by, note)


def _refund_propose_locked(
    attempt: PaymentAttempt, amount: int, reason_code: str, proposed_by: str, note: str
) -> tuple[Refund, Change | None]:
    refund = Refund.objects.create(
        purchase_id=attempt.purchase_id,
        payment_attempt=attempt,
        method=Refund.Method.LEDGER_CREDIT
        if attempt.rail == Rail.PREPAID
        else Refund.Method.PAY_BACK,
        amount=amount,
        asset=attempt.asset,
        network=attempt.network,
        payer=attempt.payer,
        reason_code=reason_code,
        transaction=attempt.tx_hash or "",
        state=Refund.State.PROPOSED,
        note=note,
        proposed_by=proposed_by,
    )
    change = Change(
        subject="refund",
        to_state=refund.state,
        reason_code=reason_code,
        evidence={"refund": refund.pk, "amount": str(amount), "note": note},
    )
    return refund, change


def refund_decide(
    *, refund_id: int, approve: bool, by: str, buyer_id: int | None, now: datetime
) -> tuple[Refund, list[Change]]:
    """Finance's decision on a proposed refund: approved, it is owed (prepaid: credited to
    the balance and paid at once); declined, nothing moves. A decided refund is returned
    unchanged with no changes."""
    with transaction.atomic():
        refund = Refund.objects.select_for_update().get(pk=refund_id)
        if refund.state != Refund.State.PROPOSED:
            return refund, []
        (refund.approve if approve else refund.decline)(by=by, at=now)
        refund.save(update_fields=["state", "decided_by", "decided_at"])
        changes = [
            Change(
                subject="refund",
                from_state=Refund.State.PROPOSED,
                to_state=refund.state,
                reason_code=refund.reason_code,
                evidence={"refund": refund.pk, "amount": str(refund.amount)},
            )
        ]
        if approve and refund.method == Refund.Method.LEDGER_CREDIT and buyer_id is not None:
            refund, paid = refund_pay_by_ledger_credit(
                refund=refund, buyer_id=buyer_id, by=by, now=now
            )
            changes.extend([paid] if paid else [])
    return refund, changes


def refund_pay_by_ledger_credit(
    *, refund: Refund, buyer_id: int, by: str, now: datetime
) -> tuple[Refund, Change | None]:
    """Pay a prepaid refund back to the buyer's balance, at once: the credit (its reference
    names the refund, so it is posted once) and the refund marked paid by it."""
    entry = ledger_credit(
        buyer_id=buyer_id,
        asset=refund.asset,
        amount=refund.amount,
        kind=LedgerEntry.Kind.REFUND_CREDIT,
        reference=f"refund:{refund.pk}",
        purchase_id=refund.purchase_id,
        memo=refund.reason_code,
    )
    return refund_mark_paid(refund_id=refund.pk, reference=entry.reference, by=by, now=now)


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


# What recording an outcome writes on the attempt (a bulk writer updates these columns).
OUTCOME_FIELDS = (
    "state",
    "tx_hash",
    "facilitator_payment_id",
    "block_number",
    "settlement_reference",
    "reason_code",
    *("block_at", "gas_used", "effective_gas_price", "sent_by"),
    "final_at",
)


def payment_attempt_apply_outcome(
    *, attempt: PaymentAttempt, outcome: SettlementOutcome, save: bool = True
) -> Change | None:
    """Move the attempt per the chain's answer. Returns what changed, or None.

    Idempotent: a second report of the same outcome writes nothing. Caller holds locks.
    `save=False` leaves the write of OUTCOME_FIELDS to a caller writing many attempts at once.
    """
    previous = attempt.state
    tx_hash = outcome.tx_hash.lower() if outcome.tx_hash else attempt.tx_hash
    if attempt.state in (PaymentAttempt.State.SUCCEEDED, PaymentAttempt.State.FAILED):
        return None
    # Kept beside the hash whatever the outcome: the facilitator's name for this settlement.
    attempt.facilitator_payment_id = str(
        outcome.evidence.get(FACILITATOR_PAYMENT_ID) or attempt.facilitator_payment_id or ""
    )[:128]
    if outcome.status == SettlementStatus.CONFIRMED:
        attempt.tx_hash = tx_hash
        attempt.block_number = outcome.block_number
        _books_evidence_take(attempt, outcome.evidence)
        attempt.succeed(settlement_reference=tx_hash or "")
        if outcome.evidence.get("final"):  # confirmed at the network's finality depth
            attempt.final_at = now_or(None)
            stamp = outcome.evidence.get("block_timestamp")
            attempt.block_at = datetime.fromtimestamp(stamp, tz=UTC) if stamp else None
    elif outcome.status == SettlementStatus.FAILED:
        attempt.fail(reason_code=outcome.reason_code)
    elif attempt.state == PaymentAttempt.State.RECORDED:
        attempt.pend(tx_hash=tx_hash)
        attempt.reason_code = outcome.reason_code
    elif (tx_hash, outcome.reason_code) == (attempt.tx_hash, attempt.reason_code):
        return None  # still pending for the same reason: nothing new for the timeline
    else:
        attempt.tx_hash, attempt.reason_code = tx_hash, outcome.reason_code
    if save:
        attempt.save(update_fields=[*OUTCOME_FIELDS, "updated_at"])
    return Change(
        subject="payment_attempt",
        from_state=previous,
        to_state=attempt.state,
        reason_code=outcome.reason_code,
        evidence={
            "attempt": attempt.pk,
            "tx_hash": tx_hash,
            "block": outcome.block_number,
            **outcome.evidence,
        },
    )


def _books_evidence_take(attempt: PaymentAttempt, evidence: dict[str, Any]) -> None:
    # Direct mode read the receipt to confirm: its gas figures and sender cost nothing more.
    if evidence.get("gas_used") is not None and evidence.get("effective_gas_price") is not None:
        attempt.gas_used = int(evidence["gas_used"])
        attempt.effective_gas_price = int(evidence["effective_gas_price"])
        attempt.sent_by = str(evidence.get("sent_by") or "").lower()


def payment_attempt_reopen(
    *, attempt: PaymentAttempt, reason_code: str, now: datetime, evidence: dict[str, Any]
) -> Change:
    """A settled attempt whose transfer a reorg undid before it was final: pending again
    (its tx hash kept as evidence), so the same authorization can be settled again. Caller
    holds the locks and writes the timeline."""
    vanished = {"attempt": attempt.pk, "tx_hash": attempt.tx_hash, "block": attempt.block_number}
    attempt.reopen(reason_code=reason_code, at=now)
    attempt.save(update_fields=[*OUTCOME_FIELDS, "reorged_at", "updated_at"])
    return Change(
        subject="payment_attempt",
        from_state=PaymentAttempt.State.SUCCEEDED,
        to_state=attempt.state,
        reason_code=reason_code,
        evidence={**vanished, **evidence},
    )
