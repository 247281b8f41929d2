"""Executions that ended unknown are asked again until the executor says for sure.

The try budget (TOLLBOOTH_EXECUTION_MAX_TRIES, _DEADLINE_MINUTES) bounds how long a worker
holds an execution, not how long we care about it: an execution that escalated as unknown
keeps being checked on a slower schedule (its next check is on the attempt), and the buyer
hears "pending" meanwhile. A check never runs the paid work twice: it polls the saved job,
or, when no job ref was saved, starts it with the purchase's own idempotency key, which the
job service answers with the job it already has. When the work turns out done, the result is
stored and delivered and the escalation closes itself; "failed" only on the executor's
definitive word. Phases: read; call the executor with no transaction open; lock, re-check,
record.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from django.db import transaction

from core.actors import Actor
from core.clock import now_or
from core.locks import locking
from fulfillment import services as fulfillment_services
from fulfillment.executors import ExecutorError, JobOutput, JobStatus, get_executor
from fulfillment.models import ExecutionAttempt
from payments import selectors as payment_selectors
from purchases.events import event_record_change, events_batched, purchase_transition
from purchases.models import Escalation, Purchase
from purchases.services.fulfil.execution import purchase_payment_evidence
from purchases.services.fulfil.result_notify import fulfillment_notify
from purchases.services.fulfil.upstreams import offering_executor, purchase_job_spec
from purchases.services.remedy.remedies import escalation_resolve, purchase_remedy_after_failure
from purchases.services.shared.job_runs import job_run
from purchases.services.shared.outbox import outbox_stage

logger = logging.getLogger(__name__)
RUN = Purchase.FulfillmentState
RECHECK_JOB = "purchase_execution_recheck"
UNKNOWN_ESCALATION = "execution_outcome_unknown"
# A staged check holds its row this long: the sweep does not stage it again while the check
# waits in the queue; a check lost with its broker is staged again after it.
RECHECK_HOLD = timedelta(minutes=5)
# The executor answered: the job exists and runs (the service is up; only time is missing).
JOB_RUNNING = "job_still_running"


class RecheckOutcome(StrEnum):
    SUCCEEDED = "succeeded"  # the job had finished: result stored, escalation closed
    FAILED = "failed"  # the executor said for sure: remedy applied, escalation closed
    STILL_UNKNOWN = "still_unknown"  # next check scheduled
    OBSERVED = "observed"  # nothing unknown to check (already resolved, or lost the race)


@dataclass(frozen=True)
class _Answer:
    outcome: RecheckOutcome
    job_ref: str
    output: JobOutput | None = None
    reason_code: str = ""
    message: str = ""


def purchase_execution_recheck(
    *, purchase_id: int, now: datetime | None = None, actor: Actor | None = None
) -> RecheckOutcome:
    """Ask the executor once more about a purchase whose execution ended unknown, and record
    what it says (on the timeline either way). Safe to run concurrently with itself: only
    the first to lock the purchase records an outcome."""
    purchase = Purchase.objects.select_related("offering", "offering__upstream", "quote").get(
        pk=purchase_id
    )
    attempt = fulfillment_services.execution_unknown_latest(purchase_id=purchase_id)
    if purchase.fulfillment_state != RUN.UNKNOWN or attempt is None:
        fulfillment_services.execution_recheck_stop(purchase_id=purchase_id)
        return RecheckOutcome.OBSERVED
    answer = _ask(purchase, attempt)
    return _record(
        purchase_id=purchase_id,
        attempt_id=attempt.pk,
        answer=answer,
        now=now_or(now),
        actor=actor or Actor.system("recheck"),
    )


def _ask(purchase: Purchase, attempt: ExecutionAttempt) -> _Answer:
    """The executor's answer, with no transaction open."""
    job_ref = attempt.job_ref
    try:
        _, upstream = offering_executor(purchase.offering)
        executor = get_executor(attempt.executor, upstream)
        if not job_ref or executor.finishes_in_start:
            # Same idempotency key as every earlier try: the service returns the job it has.
            spec = purchase_job_spec(
                purchase=purchase, idempotency_key=attempt.job_idempotency_key, upstream=upstream
            )
            started = executor.start(spec)
            if started.output is not None:
                return _Answer(RecheckOutcome.SUCCEEDED, started.job_ref, started.output)
            job_ref = started.job_ref
        status = executor.poll(job_ref)
        if status == JobStatus.SUCCEEDED:
            return _Answer(RecheckOutcome.SUCCEEDED, job_ref, executor.fetch(job_ref))
        if status == JobStatus.FAILED:
            return _Answer(RecheckOutcome.FAILED, job_ref, reason_code="job_failed")
        reason = JOB_RUNNING if status == JobStatus.RUNNING else "job_status_unknown"
        return _Answer(RecheckOutcome.STILL_UNKNOWN, job_ref, reason_code=reason)
    except ExecutorError as error:
        outcome = RecheckOutcome.FAILED if error.definitive else RecheckOutcome.STILL_UNKNOWN
        return _Answer(outcome, job_ref, reason_code=error.reason_code, message=str(error))


def _record(
    *, purchase_id: int, attempt_id: int, answer: _Answer, now: datetime, actor: Actor
) -> RecheckOutcome:
    with transaction.atomic(), events_batched():
        purchase = (
            locking(Purchase.objects)
            .select_related("offering")
            .annotate(**payment_selectors.payment_evidence_of_purchase())
            .get(pk=purchase_id)
        )
        attempt = fulfillment_services.execution_unknown_latest(purchase_id=purchase_id, lock=True)
        if purchase.fulfillment_state != RUN.UNKNOWN or attempt is None or attempt.pk != attempt_id:
            return RecheckOutcome.OBSERVED  # lost the race: another check or staff recorded it
        if answer.outcome == RecheckOutcome.STILL_UNKNOWN:
            change = fulfillment_services.execution_recheck_unknown(
                attempt=attempt,
                job_ref=answer.job_ref,
                reason_code=answer.reason_code,
                message=answer.message,
                now=now,
                job_running=answer.reason_code == JOB_RUNNING,
            )
            event_record_change(purchase=purchase, actor=actor, change=change)
            return RecheckOutcome.STILL_UNKNOWN
        if answer.outcome == RecheckOutcome.SUCCEEDED:
            _record_success(purchase=purchase, attempt=attempt, answer=answer, now=now, actor=actor)
        else:
            _record_failure(purchase=purchase, attempt=attempt, answer=answer, now=now, actor=actor)
        fulfillment_notify(purchase=purchase)
    return answer.outcome


def _record_success(
    *, purchase: Purchase, attempt: ExecutionAttempt, answer: _Answer, now: datetime, actor: Actor
) -> None:
    assert answer.output is not None
    change = fulfillment_services.execution_recheck_succeed(
        attempt=attempt,
        purchase_id=purchase.pk,
        output=answer.output,
        job_ref=answer.job_ref,
        payment=purchase_payment_evidence(purchase),
        retention=purchase.offering.result_retention,
        now=now,
    )
    event_record_change(purchase=purchase, actor=actor, change=change)
    purchase_transition(
        purchase=purchase,
        transition=purchase.fulfillment_succeed,
        actor=actor,
        update_fields=["reason_code"],
    )
    _resolve_unknown(
        purchase,
        now,
        actor,
        code="execution_completed_on_recheck",
        resolution=f"A later check found job {answer.job_ref} finished; result stored.",
    )


def _record_failure(
    *, purchase: Purchase, attempt: ExecutionAttempt, answer: _Answer, now: datetime, actor: Actor
) -> None:
    change = fulfillment_services.execution_recheck_fail(
        attempt=attempt, reason_code=answer.reason_code, now=now
    )
    event_record_change(purchase=purchase, actor=actor, change=change)
    purchase_transition(
        purchase=purchase,
        transition=purchase.fulfillment_fail,
        actor=actor,
        arguments={"reason_code": answer.reason_code},
        update_fields=["reason_code"],
    )
    _resolve_unknown(
        purchase,
        now,
        actor,
        code="execution_failed_on_recheck",
        resolution=f"A later check: the executor says the work failed ({answer.reason_code}).",
    )
    # Now provably not done: the offering's remedy applies (a refund, or an escalation).
    purchase_remedy_after_failure(
        purchase=purchase,
        reason_code=answer.reason_code,
        is_known_failure=True,
        now=now,
        actor=actor,
    )


def _resolve_unknown(
    purchase: Purchase, now: datetime, actor: Actor, *, code: str, resolution: str
) -> None:
    open_unknown = purchase.escalations.filter(
        reason_code=UNKNOWN_ESCALATION, state=Escalation.State.OPEN
    ).order_by("pk")
    for escalation in open_unknown:
        escalation_resolve(
            escalation=escalation,
            by=actor.name or actor.type,
            resolution=resolution,
            now=now,
            code=code,
            actor=actor,
        )


def executions_recheck_due(*, now: datetime | None = None) -> Counter[str]:
    """Stage a check of every unknown execution whose next check is due (JobRun
    `execution_rechecks`). Stat: `staged`."""
    now = now_or(now)
    with job_run("execution_rechecks", now) as stats, transaction.atomic():
        ids = fulfillment_services.executions_recheck_claim(now=now, hold=RECHECK_HOLD)
        for purchase_id in ids:
            outbox_stage(
                job=RECHECK_JOB,
                kwargs={"purchase_id": purchase_id},
                dedup_key=f"{RECHECK_JOB}:{purchase_id}",
                now=now,
            )
        stats["staged"] = len(ids)
    if ids:
        logger.info("staged %d checks of unknown executions", len(ids))
    return stats
