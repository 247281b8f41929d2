"""What one authorization's way to the money puts on the timeline: its first broadcast, each
drop a look-up finds, and what the settler's counterpart (a facilitator) answered.

Every event names the attempt, the submission (0: the first broadcast, n: the n-th
resubmission) and the authorization's payer and nonce, so support can follow one signed
payment through every send. The rail is never named: it describes itself (`describe`) and
marks its outcomes (`FIRST_BROADCAST`, `SETTLER_ANSWERS`).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Any

from core.actors import Actor
from payments.models import PaymentAttempt
from payments.rails import (
    FIRST_BROADCAST,
    REPLACED_SUBMISSION,
    SETTLER_ANSWERS,
    SettlementOutcome,
    rail_for,
)
from purchases import event_subjects as subjects
from purchases import sql
from purchases.events import event_note, event_record
from purchases.models import Purchase


def settlement_notes_take(
    outcome: SettlementOutcome,
) -> tuple[SettlementOutcome, bool, list[dict[str, Any]]]:
    """Split an outcome into what the attempt records and what only the timeline shows:
    (outcome without the marks, was it the first broadcast, the settler's answers)."""
    evidence = dict(outcome.evidence)
    is_first = bool(evidence.pop(FIRST_BROADCAST, False))
    answers = list(evidence.pop(SETTLER_ANSWERS, None) or [])
    return replace(outcome, evidence=evidence), is_first, answers


def payment_broadcast_record(
    *, purchase: Purchase, attempt: PaymentAttempt, outcome: SettlementOutcome, actor: Actor
) -> None:
    """The first broadcast, with how it went (and any relayer nonce gap closed before it).
    If the rail replaced it by a new submission of the same payment (its relayer nonce was
    taken), the first broadcast names what it sent, and the replacement is the attempt's
    resubmission event naming both. Inside the caller's locked transaction."""
    started = attempt.broadcast_started_at
    gap = outcome.evidence.get("relayer_gap_closed")
    replaced = outcome.evidence.get(REPLACED_SUBMISSION)
    if replaced:
        sent = {"tx_hash": replaced["replaced_tx_hash"]}
        sent["relayer_nonce"] = replaced["replaced_relayer_nonce"]
    else:
        sent = {"tx_hash": outcome.tx_hash or attempt.tx_hash or None}
        sent["relayer_nonce"] = attempt.relayer_nonce
    event_record(
        subject=subjects.PAYMENT_BROADCAST,
        purchase=purchase,
        actor=actor,
        reason_code=replaced["reason_code"] if replaced else outcome.reason_code,
        evidence={
            "attempt": attempt.pk,
            "submission": 0,
            **rail_for(attempt.rail).describe(attempt=attempt),
            **sent,
            "sent_at": started.isoformat() if started else None,
            "status": outcome.status.value,
            **({"relayer_gap_closed": gap} if gap else {}),
        },
    )
    if replaced:
        replaced_submission_record(purchase=purchase, attempt=attempt, outcome=outcome, actor=actor)


def replaced_submission_record(
    *, purchase: Purchase, attempt: PaymentAttempt, outcome: SettlementOutcome, actor: Actor
) -> None:
    """The rail replaced a submission that could never land (`REPLACED_SUBMISSION`): the
    attempt's resubmission event, naming the replaced and the new transaction and why, and
    how the new one went. Inside the caller's transaction."""
    replaced = dict(outcome.evidence[REPLACED_SUBMISSION])
    event_record(
        subject=subjects.PAYMENT_RESUBMITTED,
        purchase=purchase,
        actor=actor,
        reason_code=replaced.pop("reason_code"),
        evidence={
            "attempt": attempt.pk,
            **rail_for(attempt.rail).describe(attempt=attempt),
            **replaced,
            "answer": {"status": outcome.status.value, "reason_code": outcome.reason_code},
        },
    )


def settler_answers_record(
    *,
    purchase: Purchase,
    attempt: PaymentAttempt,
    answers: list[dict[str, Any]],
    submission: int,
    actor: Actor,
) -> None:
    """One event per answer (verify, settle) of the submission. Inside the caller's transaction."""
    for answer in answers:
        event_record(
            subject=subjects.FACILITATOR_ANSWERED,
            purchase=purchase,
            actor=actor,
            reason_code=str(answer.get("stage", "")),
            evidence={"attempt": attempt.pk, "submission": submission, **answer},
        )


def payment_drop_record(
    *, attempt: PaymentAttempt, outcome: SettlementOutcome, now: datetime, actor: Actor
) -> None:
    """A look-up found the last submission unknown to the chain, nonce unused: noted once per
    submission (0: the first broadcast). Call with no transaction open (its own statement)."""
    submission = attempt.resubmissions
    last_sent = attempt.resubmitted_at or attempt.broadcast_started_at
    once = {"attempt": attempt.pk, "submission": submission}
    evidence = {
        **once,
        **rail_for(attempt.rail).describe(attempt=attempt),
        "tx_hash": attempt.tx_hash or None,
        "nonce_state": "unused",
        "tx_known": bool(outcome.evidence.get("tx_known")),
        "last_sent_at": last_sent.isoformat() if last_sent else None,
        "looked_up_at": now.isoformat(),
    }
    # Noted once per (attempt, submission): the look-ups that find the same drop while the
    # next try waits its backoff write nothing (one statement, no lock).
    sql.payment_drop_note(
        purchase_id=attempt.purchase_id,
        actor=actor,
        reason_code=outcome.reason_code,
        evidence=evidence,
        attempt_id=attempt.pk,
        submission=submission,
    )


def relayer_gap_notes_record(*, purchase: Purchase, outcome: SettlementOutcome) -> None:
    """On the timeline of each payment whose lost relayer transaction `purchase`'s broadcast
    just re-sent or replaced (its nonce held up ours), say so. Call after that broadcast's
    record committed: each note is its own short transaction, and no other purchase's row
    is locked meanwhile (that could deadlock with a look-up recording it)."""
    for closed in outcome.evidence.get("relayer_gap_closed") or ():
        ids = closed.get("attempts") or []
        for attempt in PaymentAttempt.objects.filter(pk__in=ids).exclude(purchase=purchase):
            event_note(
                subject=subjects.PAYMENT_RELAYER_GAP_CLOSED,
                purchase=Purchase(pk=attempt.purchase_id),
                actor=Actor.system("settlement"),
                reason_code=closed["action"],
                evidence={
                    "attempt": attempt.pk,
                    **rail_for(attempt.rail).describe(attempt=attempt),
                    "tx_hash": attempt.tx_hash,
                    "relayer_nonce": closed["relayer_nonce"],
                    "sent_tx_hash": closed["tx_hash"],
                    "before_purchase": purchase.ref,
                },
            )
