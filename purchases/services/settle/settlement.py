"""Settling a recorded payment attempt, on whichever rail it is, and recording what the
money's keeper said.

An attempt whose first broadcast may already have happened is looked up before anything is
sent again; what is sent again is only ever the same signed payment, and only as
`purchases.services.settle.resubmit` allows. Network I/O happens with no transaction open; the
outcome is recorded after, under the purchase's lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import DatabaseError, transaction
from django_fsm import ConcurrentTransition, can_proceed

from core.actors import Actor
from core.bulk import bulk_update_columns
from core.changes import Change
from core.clock import now_or
from core.errors import ErrorCode
from core.waits import Awaiting
from payments.models import PaymentAttempt
from payments.rails import QuoteTerms, SettlementOutcome, SettlementStatus, rail_for
from payments.services import OUTCOME_FIELDS, payment_attempt_apply_outcome
from purchases.events import (
    event_record_change,
    events_batched,
    events_of_one_row,
    purchase_transition,
)
from purchases.models import Escalation, Offering, Purchase
from purchases.services.fulfil.sweeper import purchase_execution_stage, purchase_executions_stage
from purchases.services.quote.quotes import quote_terms
from purchases.services.remedy.remedies import escalation_open, escalation_open_payment_reversed
from purchases.services.settle.late_payments import settlement_unexpected
from purchases.services.settle.resubmit import payment_resubmit_if_due
from purchases.services.settle.settlement_events import (
    payment_broadcast_record,
    relayer_gap_notes_record,
    settlement_notes_take,
    settler_answers_record,
)

logger = logging.getLogger(__name__)
PAY = Purchase.PaymentState
TERMINAL_ATTEMPT_STATES = (PaymentAttempt.State.SUCCEEDED, PaymentAttempt.State.FAILED)


@dataclass(frozen=True)
class Settled:
    """What a settlement recorded: the outcome, and the purchase and attempt as they are now
    (read under their locks), so the caller answers without reading them again."""

    outcome: SettlementOutcome
    purchase: Purchase
    attempt: PaymentAttempt


@dataclass(frozen=True)
class SettlementUnderWay:
    """A first broadcast whose money was not proven at the first look: the wait for it, and
    what its outcome is recorded with (`settlement_finish`), read once, before the send."""

    receipt: Awaiting[SettlementOutcome]
    attempt: PaymentAttempt
    terms: QuoteTerms
    known: tuple[Purchase, PaymentAttempt] | None
    now: datetime


def purchase_settle_attempt(
    *,
    attempt_id: int,
    now: datetime | None = None,
    recorded: tuple[Purchase, PaymentAttempt, QuoteTerms] | None = None,
    wait_until: float | None = None,
) -> Settled | None:
    """Send a recorded attempt, or resume one whose sending may have happened, and record
    the outcome, sleeping through any wait for the money on this thread. Returns None when
    the attempt was already settled or failed.

    `recorded`: the purchase and attempt as this request just wrote them, with the quote's
    terms (nothing to read back, before or after). `wait_until`: the paying request's
    budget (a time.monotonic() value) the first broadcast's wait ends by, pending if not
    proven then; None (reconciliation, resubmission): the network's own timeout.
    """
    sent = purchase_settle_attempt_or_wait(
        attempt_id=attempt_id, now=now, recorded=recorded, wait_until=wait_until
    )
    if isinstance(sent, SettlementUnderWay):
        return settlement_finish(under_way=sent, outcome=sent.receipt.blocking())
    return sent


def purchase_settle_attempt_or_wait(
    *,
    attempt_id: int,
    now: datetime | None = None,
    recorded: tuple[Purchase, PaymentAttempt, QuoteTerms] | None = None,
    wait_until: float | None = None,
) -> Settled | SettlementUnderWay | None:
    """`purchase_settle_attempt`, but a wait for the money is returned, not slept through:
    the caller sleeps as it can (an event loop) and records with `settlement_finish`."""
    now = now_or(now)
    known: tuple[Purchase, PaymentAttempt] | None = None
    if recorded is not None:
        purchase, attempt, terms = recorded
        known = (purchase, attempt)
    else:
        attempt = PaymentAttempt.objects.select_related("purchase__quote__offering").get(
            pk=attempt_id
        )
        if attempt.state in TERMINAL_ATTEMPT_STATES or attempt.state == PaymentAttempt.State.HELD:
            # A held authorization is never broadcast: only its work's terminal move (or the
            # held sweep) captures it for settlement (purchases.services.settle.authorization).
            return None
        terms = quote_terms(quote=attempt.purchase.quote)
    sent = rail_for(attempt.rail).settle(
        attempt=attempt, terms=terms, now=now, wait_until=wait_until
    )
    if isinstance(sent, Awaiting):
        return SettlementUnderWay(sent, attempt, terms, known, now)
    return _settlement_record(attempt, terms, known, now, sent)


def settlement_finish(*, under_way: SettlementUnderWay, outcome: SettlementOutcome) -> Settled:
    """Record the outcome a settlement's wait ended on (after `purchase_settle_attempt`
    returned it): what the blocking wait would have recorded."""
    return _settlement_record(
        under_way.attempt, under_way.terms, under_way.known, under_way.now, outcome
    )


def _settlement_record(
    attempt: PaymentAttempt,
    terms: QuoteTerms,
    known: tuple[Purchase, PaymentAttempt] | None,
    now: datetime,
    outcome: SettlementOutcome,
) -> Settled:
    # A follow-up (a resubmission) sleeps through its own waits on this thread.
    outcome = settlement_follow_up(attempt=attempt, terms=terms, outcome=outcome, now=now)
    purchase, recorded_attempt = settlement_record_outcome(
        attempt_id=attempt.pk,
        purchase_id=attempt.purchase_id,
        outcome=outcome,
        now=now,
        known=known,
    )
    relayer_gap_notes_record(purchase=purchase, outcome=outcome)
    return Settled(outcome, purchase, recorded_attempt)


def settlement_follow_up(
    *,
    attempt: PaymentAttempt,
    outcome: SettlementOutcome,
    now: datetime,
    actor: Actor | None = None,
    terms: QuoteTerms | None = None,
) -> SettlementOutcome:
    """Act on what a look-up found before recording it: send the same signed payment again
    if it never reached the money (bounded, see resubmit), and never believe a revert until
    the payment has been looked up."""
    rail = rail_for(attempt.rail)
    outcome = payment_resubmit_if_due(
        attempt=attempt,
        terms=terms,
        outcome=outcome,
        now=now,
        actor=actor or Actor.system("settlement"),
    )
    if outcome.status == SettlementStatus.FAILED and outcome.reason_code == "transaction_reverted":
        # The attempt as committed now (its tx hash may have been written since it was read).
        outcome = rail.look_up(attempt=PaymentAttempt.objects.get(pk=attempt.pk), now=now)
    return outcome


def settlement_record_outcome(
    *,
    attempt_id: int,
    purchase_id: int,
    outcome: SettlementOutcome,
    now: datetime,
    known: tuple[Purchase, PaymentAttempt] | None = None,
) -> tuple[Purchase, PaymentAttempt]:
    """Apply the answer to the purchase and the attempt, queue the work if due. Returns both
    as recorded.

    `known`: both as this request wrote them. Then nothing is read: each write is conditional
    on the state written (the purchase's first: its row is the lock), and if anyone moved
    either since, nothing is written and both are read under their locks as without `known`.
    """
    actor = Actor.system("settlement")
    outcome, is_first_broadcast, answers = settlement_notes_take(outcome)
    if known is not None:
        try:
            with transaction.atomic(), events_batched():
                purchase, attempt = known
                return _outcome_apply(
                    purchase=purchase,
                    attempt=attempt,
                    outcome=outcome,
                    is_first_broadcast=is_first_broadcast,
                    answers=answers,
                    now=now,
                    actor=actor,
                )
        except ConcurrentTransition:
            logger.info("attempt %s moved since it was recorded; reading it locked", attempt_id)
    with transaction.atomic(), events_batched():
        purchase = (
            Purchase.objects.select_for_update(of=("self",))
            .select_related("offering", "quote")
            .get(pk=purchase_id)
        )
        attempt = PaymentAttempt.objects.select_for_update().get(pk=attempt_id)
        return _outcome_apply(
            purchase=purchase,
            attempt=attempt,
            outcome=outcome,
            is_first_broadcast=is_first_broadcast,
            answers=answers,
            now=now,
            actor=actor,
        )


def _outcome_apply(
    *,
    purchase: Purchase,
    attempt: PaymentAttempt,
    outcome: SettlementOutcome,
    is_first_broadcast: bool,
    answers: list[dict[str, Any]],
    now: datetime,
    actor: Actor,
) -> tuple[Purchase, PaymentAttempt]:
    attempt.purchase = purchase
    if is_first_broadcast:
        _first_broadcast_record(
            purchase=purchase, attempt=attempt, outcome=outcome, answers=answers, actor=actor
        )
    if (
        attempt.state == PaymentAttempt.State.FAILED
        and outcome.status == SettlementStatus.CONFIRMED
    ):
        # We had recorded this payment as failed, yet its money moved.
        settlement_unexpected(
            purchase=purchase,
            attempt=attempt,
            tx_hash=outcome.tx_hash or "",
            now=now,
            actor=actor,
        )
        purchase_queue_execution_if_due(purchase=purchase, actor=actor)
        return purchase, attempt
    applied = _apply(purchase, attempt, outcome, now=now, actor=actor)
    if applied.moved:
        purchase.save(update_fields=[*applied.moved, "updated_at"])  # both moves, one UPDATE
    if applied.queued:
        purchase_execution_stage(purchase_id=purchase.pk)
    if applied.change is not None:
        attempt.save(update_fields=[*OUTCOME_FIELDS, "updated_at"])
    return purchase, attempt


@dataclass(frozen=True)
class _Applied:
    change: Change | None  # the attempt's, None when the outcome changed nothing
    moved: list[str]  # the purchase's fields to write
    queued: bool  # the work was queued: its execution is to be staged


def _apply(
    purchase: Purchase,
    attempt: PaymentAttempt,
    outcome: SettlementOutcome,
    *,
    now: datetime,
    actor: Actor,
) -> _Applied:
    """Apply what the money's keeper said, in memory, for both recording paths (one row,
    a chunk of rows): the attempt's outcome, the purchase's payment move (a reversal
    escalated), the work queued once the payment condition holds, each move on the timeline
    through the one transition recipe. The caller writes the rows and stages the execution."""
    attempt.purchase = purchase
    change = payment_attempt_apply_outcome(attempt=attempt, outcome=outcome, save=False)
    event_record_change(purchase=purchase, actor=actor, change=change)
    if change is None or change.from_state == change.to_state:
        return _Applied(change, [], queued=False)
    moved: list[str] = []
    move = _payment_move(purchase, outcome, now, attempt)
    if move is not None:
        transition, arguments = move
        moved = purchase_transition(
            purchase=purchase,
            transition=transition,
            actor=actor,
            arguments=arguments,
            update_fields=["paid_at", "reason_code"],
            evidence={"tx_hash": attempt.tx_hash, "network": attempt.network},
            save=False,
        )
        if purchase.payment_state == PAY.REVERSED:
            escalation_open_payment_reversed(
                purchase=purchase, attempt=attempt, now=now, actor=actor
            )
        if _is_work_done_unpaid(purchase):
            escalation_open(
                purchase=purchase,
                owner=Escalation.OwnerRole.SUPPORT,
                reason_code=WORK_DONE_UNPAID,
                now=now,
                actor=actor,
                details={"attempt": attempt.pk, "reason": outcome.reason_code},
            )
    queued = can_proceed(purchase.fulfillment_queue)
    if queued:
        moved += purchase_transition(
            purchase=purchase, transition=purchase.fulfillment_queue, actor=actor, save=False
        )
    return _Applied(change, moved, queued)


# The authorization flow's bounded risk: the work ran, then its authorization could not
# land (the buyer cancelled it, drained the wallet, or the window closed). Counted by reason.
WORK_DONE_UNPAID = "work_done_unpaid"


def _is_work_done_unpaid(purchase: Purchase) -> bool:
    return (
        purchase.payment_state == PAY.FAILED
        and purchase.offering.settles_after_work
        and purchase.fulfillment_state
        in (Purchase.FulfillmentState.SUCCEEDED, Purchase.FulfillmentState.UNKNOWN)
    )


# One transaction per this many rows: its locks and statements, not one per row.
RECORD_CHUNK = 500
_PURCHASE_FIELDS = ("payment_state", "fulfillment_state", "paid_at", "reason_code", "updated_at")


@dataclass(frozen=True)
class SettlementToRecord:
    attempt_id: int
    purchase_id: int
    outcome: SettlementOutcome


def settlement_record_outcomes(
    *, rows: list[SettlementToRecord], now: datetime
) -> list[SettlementToRecord]:
    """`settlement_record_outcome` for many rows, in statements per chunk rather than per row.

    Each chunk is one transaction: lock its purchases, then its attempts (parent before
    child, by pk), apply every outcome in memory with the same transitions, then write the
    attempts, the purchases, the timeline and the staged executions in a few statements.
    Returns the rows left for the one-row path: a row whose processing raised, an outcome
    the one-row path handles itself (money landing on an attempt recorded as failed), and
    every row of a chunk whose writes the database refused (then nothing of it is written).
    """
    left: list[SettlementToRecord] = []
    for start in range(0, len(rows), RECORD_CHUNK):
        chunk = rows[start : start + RECORD_CHUNK]
        try:
            left += _record_chunk(chunk, now)
        except DatabaseError:
            logger.exception("bulk recording of %d settlements refused; one by one", len(chunk))
            left += chunk
    return left


def _record_chunk(chunk: list[SettlementToRecord], now: datetime) -> list[SettlementToRecord]:
    actor = Actor.system("settlement")
    left: list[SettlementToRecord] = []
    with transaction.atomic(), events_batched():
        purchases = {
            p.pk: p
            for p in Purchase.objects.select_for_update()
            .filter(pk__in=[row.purchase_id for row in chunk])
            .order_by("pk")
        }
        # Each offering once (a backlog shares a few), not joined and decoded per row.
        offerings = Offering.objects.in_bulk({p.offering_id for p in purchases.values()})
        for purchase in purchases.values():
            purchase.offering = offerings[purchase.offering_id]
        attempts = {
            a.pk: a
            for a in PaymentAttempt.objects.select_for_update()
            .filter(pk__in=[row.attempt_id for row in chunk])
            .order_by("pk")
        }
        moved_attempts: dict[int, PaymentAttempt] = {}
        moved_purchases: dict[int, Purchase] = {}
        seen_purchases: set[int] = set()
        to_execute: list[int] = []
        for row in chunk:
            attempt, purchase = attempts.get(row.attempt_id), purchases.get(row.purchase_id)
            if attempt is None or purchase is None or attempt.purchase_id != purchase.pk:
                left.append(row)
                continue
            if (
                purchase.pk in seen_purchases
                or attempt.reorged_at is not None
                or (
                    attempt.state == PaymentAttempt.State.FAILED
                    and row.outcome.status == SettlementStatus.CONFIRMED
                )
            ):
                # A second attempt of one purchase, a reorged one (its failure is a reversal,
                # escalated), or late money: one by one.
                left.append(row)
                continue
            seen_purchases.add(purchase.pk)
            try:
                with events_of_one_row():
                    applied = _apply(purchase, attempt, row.outcome, now=now, actor=actor)
            except Exception:
                logger.exception("settlement of attempt %s left to the one-row path", attempt.pk)
                # Its in-memory changes are dropped with it: the one-row path reloads both.
                left.append(row)
                continue
            if applied.change is not None:
                attempt.updated_at = now_or(None)
                moved_attempts[attempt.pk] = attempt
                if applied.change.from_state != applied.change.to_state:
                    purchase.updated_at = attempt.updated_at
                    moved_purchases[purchase.pk] = purchase
                if applied.queued:
                    to_execute.append(purchase.pk)
        bulk_update_columns(moved_attempts.values(), [*OUTCOME_FIELDS, "updated_at"])
        bulk_update_columns(moved_purchases.values(), _PURCHASE_FIELDS)
        purchase_executions_stage(purchase_ids=to_execute, now=now)
    return left


def _first_broadcast_record(
    *,
    purchase: Purchase,
    attempt: PaymentAttempt,
    outcome: SettlementOutcome,
    answers: list[dict[str, Any]],
    actor: Actor,
) -> None:
    """The first broadcast and what the facilitator answered to it, in the recording batch
    (no statement of their own). Resubmissions are recorded by `resubmit`."""
    payment_broadcast_record(purchase=purchase, attempt=attempt, outcome=outcome, actor=actor)
    settler_answers_record(
        purchase=purchase, attempt=attempt, answers=answers, submission=0, actor=actor
    )


def _payment_move(
    purchase: Purchase, outcome: SettlementOutcome, now: datetime, attempt: PaymentAttempt
) -> tuple[Callable[..., None], dict[str, Any]] | None:
    """The purchase's payment transition for what the money's keeper said, if any."""
    if outcome.status == SettlementStatus.CONFIRMED:
        return purchase.payment_complete, {"paid_at": now}
    if outcome.status == SettlementStatus.FAILED and attempt.reorged_at is not None:
        # It was paid (and its work may be delivered) until a reorg undid the transfer, and
        # the same authorization can no longer land: not a plain failure.
        return purchase.payment_reverse, {"reason_code": ErrorCode.PAYMENT_REVERSED.value}
    if outcome.status == SettlementStatus.FAILED:
        return purchase.payment_fail, {"reason_code": outcome.reason_code}
    if purchase.payment_state == PAY.PAYING:
        return purchase.payment_pend, {"reason_code": outcome.reason_code or "settlement_pending"}
    return None


def purchase_queue_execution_if_due(
    *, purchase: Purchase, actor: Actor, save: bool = True
) -> list[str]:
    """Queue the paid work once the offering's payment condition holds. Caller holds the
    lock. Returns the fields moved (see purchase_transition's `save`)."""
    if not can_proceed(purchase.fulfillment_queue):
        return []
    moved = purchase_transition(
        purchase=purchase, transition=purchase.fulfillment_queue, actor=actor, save=save
    )
    purchase_execution_stage(purchase_id=purchase.pk)
    return moved
