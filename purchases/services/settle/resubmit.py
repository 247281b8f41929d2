"""Resubmitting a signed payment that never reached the money: one rule, every path, every rail.

A facilitator may answer without broadcasting (`invalid_transaction_state`, a timeout with
nothing sent) and a relayer transaction may be dropped from the pool. When the chain then
shows the authorization's nonce unused and no broadcast of it pending, and the window is
still open, the SAME signed authorization is submitted again: facilitator mode calls
/settle with the same payload, direct mode re-sends the identical signed relayer bytes (or
prepares them if none were ever signed). EIP-3009 nonces are single-use, so however many
submissions reach the chain, at most one moves money; a new buyer signature is never asked.

The rail judges whether an answer proves the payment never arrived (`never_reached`) and
sends it again (`resend`); this module owns the policy. The buyer's resend, the status URL
and the reconciliation job all come through `payment_resubmit_if_due`. Tries are counted
on the attempt in the database, spaced by `BACKOFF` (the first at once once the first
submission has answered), bounded by
`SETTLEMENT_RESUBMIT_LIMIT`; past it the attempt stays pending for reconciliation (its
window closing proves the failure) and support is escalated. Every drop found (once per
submission), every try with what the facilitator answered, and the refusal at the limit,
are on the purchase's timeline, each naming the authorization's nonce.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction

from core.actors import Actor
from payments.models import PENDING_ATTEMPT_STATES, PaymentAttempt
from payments.rails import REPLACED_SUBMISSION, QuoteTerms, SettlementOutcome, rail_for
from purchases.events import event_record, events_batched
from purchases.models import Escalation, Purchase, PurchaseEvent
from purchases.services.quote.quotes import quote_terms
from purchases.services.remedy.remedies import escalation_open
from purchases.services.settle.settlement_events import (
    payment_drop_record,
    replaced_submission_record,
    settlement_notes_take,
    settler_answers_record,
)

RESUBMITTED = "payment_attempt.resubmitted"
REFUSED = "payment_attempt.resubmit_refused"
LIMIT_REACHED = "resubmission_limit_reached"
ESCALATION_REASON = "settlement_resubmissions_exhausted"
# Wait before try n (from the previous submission). The first step outlasts a facilitator
# call (twice its 10 s timeout) and a direct broadcast's receipt wait, so a submission still
# in flight is never raced; it is skipped once the first submission's answer is on record
# (`payment_resubmit_next_at`). The rest keep a facilitator that keeps refusing from being
# hammered.
BACKOFF = (
    timedelta(seconds=30),
    timedelta(minutes=2),
    timedelta(minutes=10),
    timedelta(minutes=30),
    timedelta(hours=1),
)
# What of a settler's answer goes on the timeline (never a whole body).
_ANSWER_KEYS = ("http_status", "success", "error_reason", "transaction", "transport_error", "error")


def payment_resubmit_next_at(*, attempt: PaymentAttempt) -> datetime | None:
    """When the next try is due: backoff from the last submission (None if never submitted).

    The first resubmission is due at once when the first submission's answer is recorded
    (the attempt left `recorded`): that call is over, nothing of ours is in flight, and
    EIP-3009 lets at most one submission move the money. Only a first submission that may
    still be running (its request died or is still waiting) waits the first step."""
    last = attempt.resubmitted_at or attempt.broadcast_started_at
    if last is None:
        return None
    if attempt.reorged_at is not None and last <= attempt.reorged_at:
        # A reorg undid a transfer that had landed: no submission of it can be in flight,
        # so the first one after the reorg need not wait (purchases.services.settle.finality).
        return attempt.reorged_at
    if attempt.resubmissions == 0 and attempt.state == PaymentAttempt.State.SETTLEMENT_PENDING:
        return last
    return last + BACKOFF[min(attempt.resubmissions, len(BACKOFF) - 1)]


def payment_resubmit_if_due(
    *,
    attempt: PaymentAttempt,
    outcome: SettlementOutcome,
    now: datetime,
    actor: Actor,
    terms: QuoteTerms | None = None,
) -> SettlementOutcome:
    """Send the same signed payment again if the look-up `outcome` allows it.

    Returns the new submission's outcome (evidence `resubmission`: its number), or `outcome`
    unchanged. Call with no transaction open: the rail talks to the facilitator or the node.
    """
    rail = rail_for(attempt.rail)
    if not rail.never_reached(attempt=attempt, outcome=outcome, now=now):
        return outcome
    payment_drop_record(attempt=attempt, outcome=outcome, now=now, actor=actor)
    limit = settings.TOLLBOOTH["SETTLEMENT_RESUBMIT_LIMIT"]
    described = rail.describe(attempt=attempt)
    if attempt.resubmissions >= limit:
        _refuse(attempt=attempt, described=described, limit=limit, now=now, actor=actor)
        return outcome
    due_at = payment_resubmit_next_at(attempt=attempt)
    if due_at is None or now < due_at:
        return outcome
    number = attempt.resubmissions + 1
    if not _claim(attempt, number, now):
        return outcome  # lost the race: another request or job made this try
    fresh = PaymentAttempt.objects.select_related("purchase__quote__offering").get(pk=attempt.pk)
    # The quote's terms are read only now: most look-ups never resend.
    terms = terms or quote_terms(quote=fresh.purchase.quote)
    answer, _, answers = settlement_notes_take(rail.resend(attempt=fresh, terms=terms, now=now))
    if REPLACED_SUBMISSION in answer.evidence:
        # The same bytes could never land (the rail said why): it sent a new transaction of
        # the same signed payment in their place, under this try. The event names both.
        _record_replaced(attempt=fresh, answer=answer, answers=answers, number=number, actor=actor)
        return replace(answer, evidence={**answer.evidence, "resubmission": number})
    _record_try(
        attempt=fresh,
        described=described,
        number=number,
        limit=limit,
        answer=answer,
        answers=answers,
        actor=actor,
    )
    return replace(answer, evidence={**answer.evidence, "resubmission": number})


def _claim(attempt: PaymentAttempt, number: int, now: datetime) -> bool:
    """Count the try before it leaves (write before broadcast); exactly one caller wins it."""
    return bool(
        PaymentAttempt.objects.filter(
            pk=attempt.pk, state__in=PENDING_ATTEMPT_STATES, resubmissions=number - 1
        ).update(resubmissions=number, resubmitted_at=now)
    )


def _record_try(
    *,
    attempt: PaymentAttempt,
    described: dict[str, Any],
    number: int,
    limit: int,
    answer: SettlementOutcome,
    answers: list[dict[str, Any]],
    actor: Actor,
) -> None:
    with transaction.atomic(), events_batched():
        purchase = Purchase.objects.select_for_update().get(pk=attempt.purchase_id)
        settler_answers_record(
            purchase=purchase, attempt=attempt, answers=answers, submission=number, actor=actor
        )
        event_record(
            subject=RESUBMITTED,
            purchase=purchase,
            actor=actor,
            reason_code=answer.reason_code,
            evidence={
                "attempt": attempt.pk,
                "try": number,
                "limit": limit,
                **described,
                "tx_hash": answer.tx_hash or attempt.tx_hash,
                "answer": _summary(answer),
            },
        )


def _record_replaced(
    *,
    attempt: PaymentAttempt,
    answer: SettlementOutcome,
    answers: list[dict[str, Any]],
    number: int,
    actor: Actor,
) -> None:
    with transaction.atomic(), events_batched():
        purchase = Purchase.objects.select_for_update().get(pk=attempt.purchase_id)
        settler_answers_record(
            purchase=purchase, attempt=attempt, answers=answers, submission=number, actor=actor
        )
        replaced_submission_record(purchase=purchase, attempt=attempt, outcome=answer, actor=actor)


def _summary(answer: SettlementOutcome) -> dict[str, Any]:
    seen = {key: answer.evidence[key] for key in _ANSWER_KEYS if key in answer.evidence}
    return {"status": answer.status.value, "reason_code": answer.reason_code, **seen}


def _refuse(
    *, attempt: PaymentAttempt, described: dict[str, Any], limit: int, now: datetime, actor: Actor
) -> None:
    """At the limit: no more tries. Said once on the timeline, and support is escalated; the
    attempt stays pending until its window closes (then the look-up proves it failed)."""
    with transaction.atomic():
        purchase = Purchase.objects.select_for_update().get(pk=attempt.purchase_id)
        if PurchaseEvent.objects.filter(
            purchase=purchase, subject=REFUSED, evidence__attempt=attempt.pk
        ).exists():
            return
        details = {
            "attempt": attempt.pk,
            "resubmissions": attempt.resubmissions,
            "limit": limit,
            **described,
            "tx_hash": attempt.tx_hash,
            "valid_before_at": attempt.valid_before_at.isoformat()
            if attempt.valid_before_at
            else None,
        }
        event_record(
            subject=REFUSED, purchase=purchase, actor=actor, reason_code=LIMIT_REACHED,
            evidence=details,
        )  # fmt: skip
        escalation_open(
            purchase=purchase,
            owner=Escalation.OwnerRole.SUPPORT,
            reason_code=ESCALATION_REASON,
            now=now,
            actor=actor,
            details=details,
        )
