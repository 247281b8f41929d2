"""Settling a recorded payment attempt, on whichever rail it is, and recording what the
money's keeper said.

An attempt whose first broadcast may already have happened is looked up before anything is
sent again; what is sent again is only ever the same signed payment, and only as
`purchases.services.resubmit` allows. Network I/O happens with no transaction open; the
outcome is recorded after, under the purchase's lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction

from core.actors import Actor
from core.clock import now_or
from payments.models import PaymentAttempt
from payments.rails import QuoteTerms, SettlementOutcome, SettlementStatus, rail_for
from payments.services import payment_attempt_apply_outcome
from purchases.events import event_record_change, events_batched, purchase_transition
from purchases.models import Purchase, Quote
from purchases.services.late_payments import settlement_unexpected
from purchases.services.resubmit import payment_resubmit_if_due
from purchases.services.settlement_events import (
    payment_broadcast_record,
    settlement_notes_take,
    settler_answers_record,
)
from purchases.services.sweeper import purchase_execution_stage

PAY = Purchase.PaymentState
RUN = Purchase.FulfillmentState
TERMINAL_ATTEMPT_STATES = (PaymentAttempt.State.SUCCEEDED, PaymentAttempt.State.FAILED)


def quote_terms(*, quote: Quote) -> QuoteTerms:
    """What the quote asks of the payer, as the rails take it."""
    return QuoteTerms(
        quote_id=quote.public_id,
        network=quote.network,
        asset=quote.asset,
        amount=quote.price,
        pay_to=quote.pay_to,
        duplicate_window_seconds=int(quote.offering.duplicate_window.total_seconds()),
    )


@dataclass(frozen=True)
class Settled:
    """What a settlement recorded: the outcome, and the purchase and attempt as they are now
    (read under their locks), so the caller answers without reading them again."""

    outcome: SettlementOutcome
    purchase: Purchase
    attempt: PaymentAttempt


def purchase_settle_attempt(
    *,
    attempt_id: int,
    now: datetime | None = None,
    recorded: tuple[PaymentAttempt, QuoteTerms] | None = None,
) -> Settled | None:
    """Send a recorded attempt, or resume one whose sending may have happened, and record
    the outcome. Returns None when the attempt was already settled or failed.

    `recorded`: the attempt as this request just wrote it, with its quote's terms (nothing
    to read back).
    """
    now = now_or(now)
    if recorded is not None:
        attempt, terms = recorded
    else:
        attempt = PaymentAttempt.objects.select_related("purchase__quote__offering").get(
            pk=attempt_id
        )
        if attempt.state in TERMINAL_ATTEMPT_STATES:
            return None
        terms = quote_terms(quote=attempt.purchase.quote)
    outcome = rail_for(attempt.rail).settle(attempt=attempt, terms=terms, now=now)
    outcome = settlement_follow_up(attempt=attempt, terms=terms, outcome=outcome, now=now)
    purchase, attempt = settlement_record_outcome(
        attempt_id=attempt.pk, purchase_id=attempt.purchase_id, outcome=outcome, now=now
    )
    return Settled(outcome, purchase, attempt)


def settlement_follow_up(
    *,
    attempt: PaymentAttempt,
    terms: QuoteTerms,
    outcome: SettlementOutcome,
    now: datetime,
    actor: Actor | None = None,
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
    *, attempt_id: int, purchase_id: int, outcome: SettlementOutcome, now: datetime
) -> tuple[Purchase, PaymentAttempt]:
    """Lock purchase then attempt, apply the answer to both, queue the work if due.
    Returns both as recorded."""
    actor = Actor.system("settlement")
    outcome, is_first_broadcast, answers = settlement_notes_take(outcome)
    with transaction.atomic(), events_batched():
        purchase = (
            Purchase.objects.select_for_update(of=("self",))
            .select_related("offering", "quote")
            .get(pk=purchase_id)
        )
        attempt = PaymentAttempt.objects.select_for_update().get(pk=attempt_id)
        attempt.purchase = purchase
        if is_first_broadcast:
            _first_broadcast_record(purchase, attempt, outcome, answers, actor)
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
        change = payment_attempt_apply_outcome(attempt=attempt, outcome=outcome)
        event_record_change(purchase=purchase, actor=actor, change=change)
        if change is None or change.from_state == change.to_state:
            return purchase, attempt
        move = _payment_move(purchase, outcome, now)
        moved: list[str] = []
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
        moved += purchase_queue_execution_if_due(purchase=purchase, actor=actor, save=False)
        if moved:
            purchase.save(update_fields=[*moved, "updated_at"])  # both moves, one UPDATE
    return purchase, attempt


def _first_broadcast_record(
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
    purchase: Purchase, outcome: SettlementOutcome, now: datetime
) -> tuple[Callable[..., None], dict[str, Any]] | None:
    """The purchase's payment transition for what the money's keeper said, if any."""
    if outcome.status == SettlementStatus.CONFIRMED:
        return purchase.payment_complete, {"paid_at": now}
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
    if (
        purchase.fulfillment_state != RUN.NOT_STARTED
        or not purchase.is_payment_sufficient_for_execution()
    ):
        return []
    moved = purchase_transition(
        purchase=purchase, transition=purchase.fulfillment_queue, actor=actor, save=save
    )
    purchase_execution_stage(purchase_id=purchase.pk)
    return moved


def purchase_reload(*, purchase: Purchase) -> Purchase:
    # A fresh instance, not refresh_from_db(): django-fsm's refresh toggles `protected` on
    # the shared field object, which is not safe with threads serving requests.
    return Purchase.objects.select_related("offering", "quote").get(pk=purchase.pk)
