"""Running the paid work exactly once: claim, start or resume, store, deliver.

Phases: decide and record (purchase lock); commit; call the executor; lock, re-check,
record the outcome. No executor call ever runs inside a transaction.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import StrEnum

from django.conf import settings
from django.db import transaction
from django_fsm import ConcurrentTransition

from core.actors import Actor
from core.clock import now_or
from core.locks import locking
from core.prepared import PreparedQuery
from fulfillment import services as fulfillment_services
from fulfillment.executors import (
    TOP_UP_EXECUTOR,
    Executor,
    ExecutorError,
    JobOutput,
    JobSpec,
    JobStatus,
    get_executor,
)
from fulfillment.services import (
    ExecutionClaim,
    LeaseLost,
    PaymentEvidence,
    ReceiptFacts,
    RetryBudget,
)
from payments import selectors as payment_selectors
from payments.models import Rail
from payments.rails import rail_for
from purchases.events import event_record_change, events_batched, purchase_transition
from purchases.models import Purchase
from purchases.services.fulfil.receipts import receipt_facts, receipt_resource_url
from purchases.services.fulfil.result_notify import fulfillment_notify
from purchases.services.fulfil.top_ups import top_up_credit
from purchases.services.fulfil.upstreams import offering_executor, purchase_job_spec
from purchases.services.remedy.remedies import purchase_remedy_after_failure
from purchases.services.settle.authorization import (
    WORK_SUCCEEDED,
    WORK_UNKNOWN,
    authorization_capture,
    authorization_release,
    purchase_is_held,
)

logger = logging.getLogger(__name__)
RUN = Purchase.FulfillmentState


class ExecutionOutcome(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    OBSERVED = "observed"  # another worker holds it, or there is nothing to do
    LEASE_LOST = "lease_lost"
    ESCALATED = "escalated"  # tries or deadline spent with the effect unknown: support decides


class ExecutionRetryable(Exception):
    """The executor's state is unknown for now: the task retries after `retry_in` seconds.

    The try is already counted and on the timeline, and the lease covers the wait.
    """

    def __init__(self, reason_code: str, *, retry_in: float = 0.0, tries: int = 0) -> None:
        super().__init__(reason_code)
        self.reason_code = reason_code
        self.retry_in = retry_in
        self.tries = tries


@dataclass(frozen=True)
class _Claimed:
    claim: ExecutionClaim
    spec: JobSpec
    executor_name: str
    purchase: Purchase  # as claimed (with its payment evidence annotated)


def purchase_execute(*, purchase_id: int, worker: str) -> ExecutionOutcome:
    """Run (or resume) the purchase's paid work once.

    Every try is counted on the execution attempt. Raises ExecutionRetryable when the
    executor cannot say what happened yet and tries remain; once the tries or the deadline
    are spent the execution ends unknown and escalates to support (ESCALATED).
    """
    return purchase_execute_keeping(purchase_id=purchase_id, worker=worker).outcome


@dataclass(frozen=True)
class Executed:
    outcome: ExecutionOutcome
    # SUCCEEDED: the purchase as the run's last write left it (the conditional UPDATE that
    # moved it to succeeded, committed with the result), with its offering and quote: a
    # caller answering the buyer needs not read it again. None otherwise.
    purchase: Purchase | None = None


def purchase_execute_keeping(*, purchase_id: int, worker: str) -> Executed:
    """`purchase_execute`, keeping the purchase a successful run wrote (see Executed)."""
    claimed = _claim(purchase_id, worker)
    if claimed is None:
        return Executed(ExecutionOutcome.OBSERVED)
    if claimed.claim.spent_reason:
        # A try ended without recording its failure (crash, kill): the budget is spent anyway.
        _end(purchase_id, claimed.claim, claimed.claim.spent_reason, is_known_failure=False)
        return Executed(ExecutionOutcome.ESCALATED)
    refused = _held_payment_refused(claimed)
    if refused:
        # Nothing ran: the held authorization can no longer pay for it (the buyer cancelled
        # it or moved the funds away), so the work is not done for nothing.
        _end(purchase_id, claimed.claim, refused, is_known_failure=True)
        return Executed(ExecutionOutcome.FAILED)
    try:
        executor = get_executor(claimed.executor_name, claimed.spec.upstream)
        output, job_ref = _run(executor, claimed)
    except LeaseLost:
        logger.warning("purchase %s: lease lost to another worker", purchase_id)
        return Executed(ExecutionOutcome.LEASE_LOST)
    except ExecutorError as error:
        if not error.definitive and not error.retryable:
            # The effect happened or may have, and another call cannot settle it: escalate.
            _end(purchase_id, claimed.claim, error.reason_code, is_known_failure=False)
            return Executed(ExecutionOutcome.ESCALATED)
        if not error.definitive:
            return Executed(_retry_or_give_up(purchase_id, claimed.claim, error))
        _end(purchase_id, claimed.claim, error.reason_code, is_known_failure=True)
        return Executed(ExecutionOutcome.FAILED)
    return _succeed(claimed, output, job_ref)


def _held_payment_refused(claimed: _Claimed) -> str:
    """Under the authorization flow, just before the work first starts: why the held
    payment could no longer be settled ("" when it still can, or nobody can say now)."""
    purchase = claimed.purchase
    if not purchase_is_held(purchase) or claimed.claim.job_ref:
        return ""
    attempt = payment_selectors.payment_attempt_held(purchase_id=purchase.pk)
    if attempt is None:
        return ""
    return rail_for(attempt.rail).held_can_land(attempt=attempt, now=now_or(None))


def _retry_or_give_up(
    purchase_id: int, claim: ExecutionClaim, error: ExecutorError
) -> ExecutionOutcome:
    with transaction.atomic(), events_batched():
        purchase = locking(Purchase.objects).get(pk=purchase_id)
        try:
            decision = fulfillment_services.execution_record_retry(
                claim=claim, reason_code=error.reason_code, message=str(error), now=now_or(None)
            )
        except LeaseLost:
            return ExecutionOutcome.LEASE_LOST
        event_record_change(
            purchase=purchase, actor=Actor.system("executor"), change=decision.change
        )
    if decision.give_up_reason:
        _end(purchase_id, claim, decision.give_up_reason, is_known_failure=False)
        return ExecutionOutcome.ESCALATED
    raise ExecutionRetryable(
        error.reason_code, retry_in=decision.retry_in, tries=decision.tries
    ) from error


# Every execution's first read, compiled once per process (core.prepared): the purchase
# locked, with its offering, quote and payment evidence.
_CLAIM_READ = PreparedQuery(
    lambda pk: (
        locking(Purchase.objects)
        .select_related("offering", "offering__upstream", "quote")
        .annotate(**payment_selectors.payment_evidence_of_purchase())
        .filter(pk=pk)
    ),
    pk=int,
)


def _claim(purchase_id: int, worker: str) -> _Claimed | None:
    actor = Actor.system(worker)
    with transaction.atomic(), events_batched():
        purchase = _CLAIM_READ.get(pk=purchase_id)
        if purchase.fulfillment_state not in (RUN.QUEUED, RUN.RUNNING):
            return None  # finished, failed or not paid yet: nothing for a worker to do
        now = now_or(None)
        executor_name, upstream = offering_executor(purchase.offering)
        claim = fulfillment_services.execution_claim(
            purchase_id=purchase.pk,
            purchase_ref=purchase.ref,
            executor=executor_name,
            worker=worker,
            now=now,
            may_be_running=purchase.fulfillment_state == RUN.RUNNING,
            budget=RetryBudget.of(  # the offering's own, where its upstream sets one
                max_tries=upstream.max_tries if upstream else None,
                deadline_seconds=upstream.deadline_seconds if upstream else None,
            ),
        )
        if claim is None:
            return None
        event_record_change(purchase=purchase, actor=actor, change=claim.change)
        if purchase.fulfillment_state == RUN.QUEUED:
            purchase_transition(
                purchase=purchase, transition=purchase.fulfillment_start, actor=actor
            )
        spec = purchase_job_spec(
            purchase=purchase, idempotency_key=claim.job_idempotency_key, upstream=upstream
        )
        return _Claimed(claim, spec, executor_name, purchase)


def _run(executor: Executor, claimed: _Claimed) -> tuple[JobOutput, str]:
    """The job's output and its ref."""
    claim = claimed.claim
    job_ref = claim.job_ref
    if not job_ref or executor.finishes_in_start:
        # Safe even after a crash between "job created" and "job ref saved": the job service
        # answers a repeated start with the same idempotency key with the job it already has.
        started = executor.start(claimed.spec)
        if started.output is not None and executor.finishes_in_start:
            # Done within the call, and redone from the start after any crash: its ref goes
            # on the attempt with the outcome, in the UPDATE that records it.
            return started.output, started.job_ref
        if started.job_ref != job_ref:
            fulfillment_services.execution_record_job_ref(
                claim=claim, job_ref=started.job_ref, now=now_or(None)
            )
        if started.output is not None:
            return started.output, started.job_ref
        job_ref = started.job_ref
    return _wait_for_job(executor, claim, job_ref), job_ref


def _wait_for_job(executor: Executor, claim: ExecutionClaim, job_ref: str) -> JobOutput:
    interval = float(settings.TOLLBOOTH["EXECUTION_POLL_INTERVAL"])
    deadline = time.monotonic() + settings.CELERY_TASK_SOFT_TIME_LIMIT - 30
    unknown_in_a_row = 0
    while time.monotonic() < deadline:
        status = executor.poll(job_ref)
        fulfillment_services.execution_renew_lease(claim=claim, now=now_or(None))
        if status == JobStatus.SUCCEEDED:
            return executor.fetch(job_ref)
        if status == JobStatus.FAILED:
            raise ExecutorError("job_failed", definitive=True)
        unknown_in_a_row = unknown_in_a_row + 1 if status == JobStatus.UNKNOWN else 0
        if unknown_in_a_row >= 5:
            raise ExecutorError("job_status_unknown")
        time.sleep(interval)
    raise ExecutorError("job_still_running")


def purchase_payment_evidence(purchase: Purchase) -> PaymentEvidence:
    """From the purchase read with `payment_reference` annotated: its settled attempt's
    transaction, or (delivery on verification) the live attempt's whose settlement is under
    way, on that attempt's network (a prepaid payment's is `prepaid`). Payer, amount and
    asset are the purchase's own (verified equal)."""
    reference = getattr(purchase, "payment_reference", None)
    if not reference:
        raise RuntimeError(f"purchase {purchase.ref} executed without a payment")
    return PaymentEvidence(
        payer=purchase.payer,
        amount=purchase.amount,
        asset=purchase.asset,
        network=getattr(purchase, "payment_network", purchase.network),
        transaction=reference,
        receipt=_receipt_facts_if_final(purchase),
    )


def _receipt_facts_if_final(purchase: Purchase) -> ReceiptFacts | None:
    """A payment already final (prepaid, or a settlement final with its block time known):
    the receipt is signed as it is stored. Otherwise it is issued once final (receipts)."""
    if purchase.rail == Rail.PREPAID:
        return receipt_facts(purchase=purchase, attempt=None)
    mined_at = getattr(purchase, "payment_mined_at", None)
    if mined_at is None or purchase.payment_state != Purchase.PaymentState.PAID:
        return None
    slug = purchase.offering.slug
    return ReceiptFacts(
        purchase_ref=purchase.ref,
        offering=slug,
        resource_url=receipt_resource_url(offering_slug=slug),
        settled_at=mined_at,
    )


def _succeed(claimed: _Claimed, output: JobOutput, job_ref: str) -> Executed:
    """Store the result and move the purchase. A purchase claimed paid is moved on the row as
    claimed: its conditional UPDATE (still running, still paid) is the lock and nothing is
    read again; if it moved meanwhile, it is read again under its lock."""
    if claimed.purchase.payment_state == Purchase.PaymentState.PAID:
        try:
            return _succeed_once(claimed.purchase, claimed, output, job_ref)
        except ConcurrentTransition:
            logger.info("purchase %s moved while it ran; reading it locked", claimed.purchase.pk)
    return _succeed_once(None, claimed, output, job_ref)


def _succeed_once(
    known: Purchase | None, claimed: _Claimed, output: JobOutput, job_ref: str
) -> Executed:
    claim = claimed.claim
    actor = Actor.system("executor")
    try:
        with transaction.atomic(), events_batched():
            if known is None:
                purchase = (
                    locking(Purchase.objects)
                    .select_related("offering")
                    .annotate(**payment_selectors.payment_evidence_of_purchase())
                    .get(pk=claimed.purchase.pk)
                )
                fulfillment_services.execution_check_lease(claim=claim)  # before anything moves
            else:
                purchase = known
            now = now_or(None)
            if claimed.executor_name == TOP_UP_EXECUTOR:
                # The top-up's credit is its work: posted here, with its result (top_ups).
                output = top_up_credit(purchase=purchase)
            change = fulfillment_services.execution_success_change(
                claim=claim, output=output, job_ref=job_ref
            )
            event_record_change(purchase=purchase, actor=actor, change=change)
            purchase_transition(
                purchase=purchase,
                transition=purchase.fulfillment_succeed,
                actor=actor,
                update_fields=["reason_code"],
            )
            if purchase_is_held(purchase):
                # The authorization flow's terminal move: settle it, with the result stored.
                authorization_capture(
                    purchase=purchase, actor=actor, reason_code=WORK_SUCCEEDED, now=now
                )
            result, receipt, _ = fulfillment_services.execution_succeed(
                purchase_id=purchase.pk,
                claim=claim,
                output=output,
                payment=purchase_payment_evidence(purchase),
                retention=purchase.offering.result_retention,
                now=now,
                job_ref=job_ref,
            )
            fulfillment_notify(purchase=purchase)
        # Kept on the purchase as written, so an answer delivering them from this run reads
        # neither back (delivery's _result_and_receipt). After the commit: a rolled-back
        # block leaves nothing cached.
        purchase.result = result
        purchase.receipt = receipt
    except LeaseLost:
        return Executed(ExecutionOutcome.LEASE_LOST)  # nothing written: the block rolled back
    return Executed(ExecutionOutcome.SUCCEEDED, purchase)


def _end(
    purchase_id: int, claim: ExecutionClaim, reason_code: str, *, is_known_failure: bool
) -> None:
    """Record a failed (provably did not run) or unknown (may have run) execution and its remedy."""
    with transaction.atomic(), events_batched():
        purchase = locking(Purchase.objects).select_related("offering").get(pk=purchase_id)
        actor = Actor.system("executor")
        now = now_or(None)
        try:
            change = fulfillment_services.execution_end(
                claim=claim, reason_code=reason_code, is_known_failure=is_known_failure, now=now
            )
        except LeaseLost:
            return
        event_record_change(purchase=purchase, actor=actor, change=change)
        purchase_transition(
            purchase=purchase,
            transition=(
                purchase.fulfillment_fail if is_known_failure else purchase.fulfillment_lose_track
            ),
            actor=actor,
            arguments={"reason_code": reason_code},
            update_fields=["reason_code"],
        )
        if purchase_is_held(purchase) and is_known_failure:
            # Nothing was charged: never settle it, and there is nothing to refund.
            authorization_release(purchase=purchase, actor=actor, reason_code=reason_code)
            fulfillment_notify(purchase=purchase)
            return
        if purchase_is_held(purchase):
            # Unknown with the tries spent: settled now and kept unknown (a refund is owed if
            # it later proves failed), while the authorization can still land.
            authorization_capture(purchase=purchase, actor=actor, reason_code=WORK_UNKNOWN, now=now)
        purchase_remedy_after_failure(
            purchase=purchase,
            reason_code=reason_code,
            is_known_failure=is_known_failure,
            now=now,
            actor=actor,
        )
        fulfillment_notify(purchase=purchase)


def purchase_execution_give_up(*, purchase_id: int, worker: str, reason_code: str) -> None:
    """The executor stayed unreachable through every retry: the effect is unknown, so escalate.

    Never a refund here: the work may have run. Support decides from the job service's evidence.
    """
    with transaction.atomic(), events_batched():
        purchase = locking(Purchase.objects).get(pk=purchase_id)
        live = fulfillment_services.execution_live_attempt(purchase_id=purchase.pk)
        if live is None or purchase.fulfillment_state != RUN.RUNNING:
            return
        claim = ExecutionClaim(
            live.pk, live.lease_token, live.job_ref, live.job_idempotency_key, False
        )
    _end(purchase_id, claim, reason_code, is_known_failure=False)
