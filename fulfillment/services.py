"""Execution attempts, leases, results and receipts.

The purchases orchestration locks the purchase row and calls these inside its transaction;
lease renewal is the one write made outside it (a conditional update on the attempt).
They take the purchase's id and plain values and return what changed (core.changes.Change)
for the orchestration to put on the purchase's timeline.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django_fsm import ConcurrentTransition

from core.backoff import backoff_delay
from core.changes import Change
from core.refs import new_ref
from fulfillment import receipt_signing
from fulfillment.executors import JobOutput
from fulfillment.models import ExecutionAttempt, Receipt, Result
from fulfillment.sql import result_insert_with_receipt


class LeaseLost(Exception):
    """Another worker took the execution over after our lease expired: stop quietly."""


@dataclass(frozen=True)
class RetryBudget:
    """How long an execution whose outcome stays unknown is tried: the offering's upstream
    says, else the deployment (TOLLBOOTH_EXECUTION_MAX_TRIES / _DEADLINE)."""

    max_tries: int
    deadline: timedelta

    @classmethod
    def of(
        cls, *, max_tries: int | None = None, deadline_seconds: int | None = None
    ) -> RetryBudget:
        return cls(
            max_tries=int(max_tries or settings.TOLLBOOTH["EXECUTION_MAX_TRIES"]),
            deadline=(
                timedelta(seconds=deadline_seconds)
                if deadline_seconds
                else settings.TOLLBOOTH["EXECUTION_DEADLINE"]
            ),
        )


@dataclass(frozen=True)
class ExecutionClaim:
    attempt_id: int
    lease_token: str
    job_ref: str
    job_idempotency_key: str
    is_takeover: bool
    tries: int = 0
    # Set when the execution has spent its tries or passed its deadline: end it, do not run.
    spent_reason: str = ""
    change: Change | None = None
    budget: RetryBudget | None = None  # None: the deployment's settings


@dataclass(frozen=True)
class RetryDecision:
    tries: int
    retry_in: float  # seconds until the next try is due; 0 when giving up
    give_up_reason: str  # "" while tries remain
    change: Change


def _lease_until(now: datetime) -> datetime:
    lease: timedelta = settings.TOLLBOOTH["EXECUTION_LEASE"]
    return now + lease


def _budget_spent(attempt: ExecutionAttempt, now: datetime, budget: RetryBudget) -> str:
    """Why no further try may start on this attempt, or "" if one may."""
    if attempt.tries >= budget.max_tries:
        return "execution_tries_exhausted"
    if now >= attempt.started_at + budget.deadline:
        return "execution_deadline_passed"
    return ""


def _backoff_seconds(tries: int) -> float:
    # From the database's count of tries: base, 2x base ... capped at 10 min.
    base = float(settings.TOLLBOOTH["EXECUTION_RETRY_BACKOFF_SECONDS"])
    delay = backoff_delay(tries, base_seconds=base, cap_seconds=600.0, jitter=(1.0, 1.25))
    return delay.total_seconds()


def execution_live_attempt(*, purchase_id: int) -> ExecutionAttempt | None:
    return (
        ExecutionAttempt.objects.select_for_update()
        .filter(purchase_id=purchase_id, state=ExecutionAttempt.State.RUNNING)
        .first()
    )


def execution_claim(
    *,
    purchase_id: int,
    purchase_ref: str,
    executor: str,
    worker: str,
    now: datetime,
    may_be_running: bool = True,
    budget: RetryBudget | None = None,
) -> ExecutionClaim | None:
    """Claim the purchase's execution for `worker`, or return None if someone else holds it.

    The caller holds the purchase row lock; the partial unique index on running attempts
    backs it up, so two workers can never both hold a live attempt. `may_be_running=False`
    (the purchase is only queued) skips the look for a running attempt to take over: if one
    existed anyway, the index refuses the second one. `budget`: the offering's tries and
    deadline (default: the deployment's), carried on the claim to every later decision.
    """
    assert transaction.get_connection().in_atomic_block
    budget = budget or RetryBudget.of()
    token = secrets.token_hex(8)
    live = execution_live_attempt(purchase_id=purchase_id) if may_be_running else None
    if live is not None:
        is_own_retry = live.worker == worker  # a Celery retry keeps its task id, so its name
        if live.lease_expires_at > now and not is_own_retry:
            return None  # lost the race: another worker is running it and renewing its lease
        previous_worker = live.worker
        spent_reason = _budget_spent(live, now, budget)
        live.worker, live.lease_token, live.lease_expires_at = worker, token, _lease_until(now)
        live.takeovers += 0 if is_own_retry else 1
        if not spent_reason:
            live.tries = F("tries") + 1  # type: ignore[assignment]  # a try starts: count it
        live.save(update_fields=["worker", "lease_token", "lease_expires_at", "takeovers", "tries"])
        live.refresh_from_db(fields=["tries"])
        change = Change(
            subject="execution_attempt",
            from_state=live.state,
            to_state=live.state,
            reason_code="lease_resumed_by_retry" if is_own_retry else "lease_expired_taken_over",
            evidence={
                "attempt": live.pk,
                "previous_worker": previous_worker,
                "worker": worker,
                "job_ref": live.job_ref,
                "try": live.tries,
            },
        )
        return ExecutionClaim(
            live.pk,
            token,
            live.job_ref,
            live.job_idempotency_key,
            is_takeover=True,
            tries=live.tries,
            spent_reason=spent_reason,
            change=change,
            budget=budget,
        )
    attempt = ExecutionAttempt.objects.create(
        purchase_id=purchase_id,
        executor=executor,
        worker=worker,
        lease_token=token,
        lease_expires_at=_lease_until(now),
        started_at=now,
        tries=1,
        # One key per purchase, not per attempt: a restarted attempt finds the first job.
        job_idempotency_key=f"tollbooth-{purchase_ref}",
    )
    change = Change(
        subject="execution_attempt",
        to_state=attempt.state,
        evidence={"attempt": attempt.pk, "worker": worker, "try": 1},
    )
    return ExecutionClaim(
        attempt.pk,
        token,
        "",
        attempt.job_idempotency_key,
        is_takeover=False,
        tries=1,
        change=change,
        budget=budget,
    )


def execution_record_retry(
    *, claim: ExecutionClaim, reason_code: str, message: str, now: datetime
) -> RetryDecision:
    """Put a try that ended with the effect unknown on the timeline, and say what comes next.

    Another try is due after a backoff (the lease is stretched over it, so the sweeper does
    not start a second task meanwhile), or the tries or the deadline are spent. Caller holds
    the purchase lock. Raises LeaseLost if another worker holds the attempt now.
    """
    attempt = _locked_own_attempt(claim)
    budget = claim.budget or RetryBudget.of()
    give_up_reason = _budget_spent(attempt, now, budget)
    retry_in = 0.0 if give_up_reason else _backoff_seconds(attempt.tries)
    if not give_up_reason:
        attempt.lease_expires_at = _lease_until(now + timedelta(seconds=retry_in))
        attempt.save(update_fields=["lease_expires_at"])
    change = Change(
        subject="execution_attempt.retried",  # purchases.event_subjects.EXECUTION_RETRIED
        from_state=attempt.state,
        to_state=attempt.state,
        reason_code="executor_retry",
        evidence={
            "attempt": attempt.pk,
            "try": attempt.tries,
            "max_tries": budget.max_tries,
            "deadline_at": (attempt.started_at + budget.deadline).isoformat(),
            "error": reason_code,
            "message": message[:500],
            "job_ref": attempt.job_ref,
            "retry_in_seconds": round(retry_in, 3),
            "give_up": give_up_reason,
        },
    )
    return RetryDecision(attempt.tries, retry_in, give_up_reason, change)


def execution_renew_lease(*, claim: ExecutionClaim, now: datetime) -> None:
    """Extend our lease. Raises LeaseLost if another worker has taken the attempt over."""
    renewed = ExecutionAttempt.objects.filter(
        pk=claim.attempt_id, lease_token=claim.lease_token, state=ExecutionAttempt.State.RUNNING
    ).update(lease_expires_at=_lease_until(now))
    if not renewed:
        raise LeaseLost(claim.attempt_id)


def execution_record_job_ref(*, claim: ExecutionClaim, job_ref: str, now: datetime) -> None:
    """Save the job ref the moment it exists: one conditional UPDATE (our lease, still
    running, no other job recorded), which is also the lock."""
    saved = (
        ExecutionAttempt.objects.filter(
            pk=claim.attempt_id, lease_token=claim.lease_token, state=ExecutionAttempt.State.RUNNING
        )
        .filter(Q(job_ref="") | Q(job_ref=job_ref))
        .update(job_ref=job_ref, lease_expires_at=_lease_until(now))
    )
    if saved:
        return
    attempt = _locked_own_attempt(claim)  # raises LeaseLost if the lease is gone
    raise RuntimeError(f"attempt {attempt.pk} already has job {attempt.job_ref}, got {job_ref}")


def _locked_own_attempt(claim: ExecutionClaim) -> ExecutionAttempt:
    attempt = ExecutionAttempt.objects.select_for_update().get(pk=claim.attempt_id)
    if attempt.lease_token != claim.lease_token or attempt.state != ExecutionAttempt.State.RUNNING:
        raise LeaseLost(claim.attempt_id)
    return attempt


@dataclass(frozen=True)
class ReceiptFacts:
    """What a signed receipt says beyond the receipt row: known to the purchases app."""

    purchase_ref: str
    offering: str
    resource_url: str
    settled_at: datetime  # the block's timestamp (x402), the debit's time (prepaid)


@dataclass(frozen=True)
class PaymentEvidence:
    payer: str
    amount: int
    asset: str
    network: str
    transaction: str
    # Set when the payment is final already: the receipt is signed as it is stored.
    receipt: ReceiptFacts | None = None


def execution_succeed(
    *,
    purchase_id: int,
    claim: ExecutionClaim,
    output: JobOutput,
    payment: PaymentEvidence,
    retention: timedelta,
    now: datetime,
    job_ref: str = "",
) -> tuple[Result, Receipt, Change]:
    """Store the result and its SHA-256 and write the receipt (both returned as written: the
    receipt without its id). Caller holds the purchase lock (or has just moved the purchase
    by a conditional UPDATE, which is the lock).

    `job_ref` is the job that produced the output when it was not recorded before (work that
    finishes inside its start call): it goes on the attempt with the outcome. Raises LeaseLost
    if another worker holds the attempt now: nothing is written then.
    """
    attempt = ExecutionAttempt.held(
        attempt_id=claim.attempt_id, lease_token=claim.lease_token, job_ref=job_ref or claim.job_ref
    )
    attempt.succeed(at=now)
    try:
        attempt.save(update_fields=["state", "finished_at", "job_ref"])
    except ConcurrentTransition as lost:
        raise LeaseLost(claim.attempt_id) from lost
    result, receipt = _result_store(
        purchase_id=purchase_id,
        attempt=attempt,
        output=output,
        payment=payment,
        retention=retention,
        now=now,
    )
    return result, receipt, execution_success_change(claim=claim, output=output, job_ref=job_ref)


def _result_store(
    *,
    purchase_id: int,
    attempt: ExecutionAttempt,
    output: JobOutput,
    payment: PaymentEvidence,
    retention: timedelta,
    now: datetime,
) -> tuple[Result, Receipt]:
    """The result, its SHA-256 and the receipt, for the attempt that produced them."""
    digest = hashlib.sha256(output.content).hexdigest()
    result = Result(
        purchase_id=purchase_id,
        execution=attempt,
        content_type=output.content_type,
        body=output.content,
        sha256=digest,
        size=len(output.content),
        created_at=now,
        expires_at=now + retention,
    )
    receipt = Receipt(
        public_id=new_ref("rcp"),
        purchase_id=purchase_id,
        payer=payment.payer,
        amount=payment.amount,
        asset=payment.asset,
        network=payment.network,
        transaction=payment.transaction,
        body_sha256=digest,
        delivered_at=now,
    )
    if payment.receipt is not None:
        receipt_sign_into(receipt=receipt, facts=payment.receipt, now=now)
    if not result_insert_with_receipt(result=result, receipt=receipt):
        raise RuntimeError(f"purchase {purchase_id} already has a result")  # one lease, one run
    return result, receipt


def receipt_payload(
    *, receipt: Receipt, facts: ReceiptFacts, issued_at: datetime
) -> dict[str, Any]:
    """The fields a receipt signs (fulfillment.receipt_signing.RECEIPT_FIELDS)."""
    return {
        "version": receipt_signing.RECEIPT_VERSION,
        "network": receipt.network,
        "resourceUrl": facts.resource_url,
        "payer": receipt.payer,
        "issuedAt": int(issued_at.timestamp()),
        "transaction": receipt.transaction,
        "receipt": receipt.public_id,
        "purchase": facts.purchase_ref,
        "offering": facts.offering,
        "amount": str(receipt.amount),
        "asset": receipt.asset,
        "settledAt": int(facts.settled_at.timestamp()),
        "resultSha256": receipt.body_sha256,
    }


def receipt_sign_into(*, receipt: Receipt, facts: ReceiptFacts, now: datetime) -> None:
    """Sign the receipt with the current key, on the row in memory (the caller saves it)."""
    key = receipt_signing.signing_key()
    payload = receipt_payload(receipt=receipt, facts=facts, issued_at=now)
    receipt.signed = receipt_signing.receipt_sign(payload=payload, key=key)
    receipt.key_id, receipt.issued_at = key.key_id, now


def receipt_issue(*, receipt: Receipt, facts: ReceiptFacts, now: datetime) -> str:
    """The receipt's signed text: the stored one, or signed now and stored by one conditional
    UPDATE (still unsigned). Of two issuers racing, the first stored wins and both return
    it: a receipt is issued once and is the same bytes for ever after."""
    if receipt.signed:
        return receipt.signed
    receipt_sign_into(receipt=receipt, facts=facts, now=now)
    stored = Receipt.objects.filter(pk=receipt.pk, signed="").update(
        signed=receipt.signed, key_id=receipt.key_id, issued_at=receipt.issued_at
    )
    if not stored:  # lost the race: another issuer stored its signature first
        receipt.refresh_from_db(fields=["signed", "key_id", "issued_at"])
    return receipt.signed


def execution_success_change(*, claim: ExecutionClaim, output: JobOutput, job_ref: str) -> Change:
    """What execution_succeed changes, known before it writes (for the timeline's order)."""
    return Change(
        subject="execution_attempt",
        from_state=ExecutionAttempt.State.RUNNING,
        to_state=ExecutionAttempt.State.SUCCEEDED,
        evidence={
            "attempt": claim.attempt_id,
            "job_ref": job_ref or claim.job_ref,
            "sha256": hashlib.sha256(output.content).hexdigest(),
            "size": len(output.content),
        },
    )


def execution_check_lease(*, claim: ExecutionClaim) -> None:
    """Raises LeaseLost unless the attempt is still running under our lease (locks it)."""
    _locked_own_attempt(claim)


def execution_end(
    *, claim: ExecutionClaim, reason_code: str, is_known_failure: bool, now: datetime
) -> Change:
    """End an attempt as failed (the work provably did not happen) or unknown (it may have)."""
    attempt = _locked_own_attempt(claim)
    evidence: dict[str, Any] = {"attempt": attempt.pk, "job_ref": attempt.job_ref}
    if is_known_failure:
        attempt.fail(reason_code=reason_code, at=now)
    else:
        attempt.lose_track(reason_code=reason_code, at=now)
        # Unknown is not the end: the job is asked again
        # (purchases.services.fulfil.execution_recheck).
        attempt.next_check_at = execution_next_check_at(checks=0, now=now)
        evidence["next_check_at"] = attempt.next_check_at.isoformat()
    attempt.save(update_fields=["state", "reason_code", "finished_at", "next_check_at"])
    return Change(
        subject="execution_attempt",
        from_state=ExecutionAttempt.State.RUNNING,
        to_state=attempt.state,
        reason_code=reason_code,
        evidence={**evidence, "tries": attempt.tries},
    )


# --- executions that ended unknown: asked again until the executor says for sure ----------


def execution_next_check_at(*, checks: int, now: datetime) -> datetime:
    """When an unknown execution's job is asked next: the first wait, doubled per check
    already made, capped (TOLLBOOTH_EXECUTION_RECHECK_SECONDS / _MAX_SECONDS)."""
    first = float(settings.TOLLBOOTH["EXECUTION_RECHECK_SECONDS"])
    cap = float(settings.TOLLBOOTH["EXECUTION_RECHECK_MAX_SECONDS"])
    return now + timedelta(seconds=min(cap, first * 2 ** min(checks, 20)))


def executions_recheck_claim(*, now: datetime, hold: timedelta, limit: int = 200) -> list[int]:
    """The purchases whose unknown execution is due for a check, each held for `hold` (its
    next check moved past it), so the next sweep does not stage it again while its check is
    queued. Caller's transaction."""
    assert transaction.get_connection().in_atomic_block
    due = list(
        ExecutionAttempt.objects.select_for_update(skip_locked=True)
        .filter(state=ExecutionAttempt.State.UNKNOWN, next_check_at__lte=now)
        .order_by("next_check_at", "pk")
        .values_list("pk", "purchase_id")[:limit]
    )
    ExecutionAttempt.objects.filter(pk__in=[pk for pk, _ in due]).update(next_check_at=now + hold)
    return [purchase_id for _, purchase_id in due]


def execution_unknown_latest(*, purchase_id: int, lock: bool = False) -> ExecutionAttempt | None:
    """The purchase's latest execution attempt if it ended unknown, else None."""
    attempts = ExecutionAttempt.objects.filter(purchase_id=purchase_id).order_by("-pk")
    latest = (attempts.select_for_update() if lock else attempts).first()
    return latest if latest and latest.state == ExecutionAttempt.State.UNKNOWN else None


def execution_recheck_stop(*, purchase_id: int) -> int:
    """No more checks for this purchase's unknown attempts (its fulfilment moved on some
    other way): without it the sweep would stage a check that finds nothing, forever."""
    return ExecutionAttempt.objects.filter(
        purchase_id=purchase_id, state=ExecutionAttempt.State.UNKNOWN, next_check_at__isnull=False
    ).update(next_check_at=None)


def execution_recheck_unknown(
    *,
    attempt: ExecutionAttempt,
    job_ref: str,
    reason_code: str,
    message: str,
    now: datetime,
    job_running: bool = False,
) -> Change:
    """Still unknown after this check: count it and schedule the next; a job ref learned by
    this check (the job existed after all) is saved. `job_running`: the executor answered
    that the job runs, so the next check polls it as a worker would (the execution poll
    interval: the next sweep), not after the backoff an outage grew. Caller holds locks."""
    attempt.checks += 1
    if job_running:
        poll = float(settings.TOLLBOOTH["EXECUTION_POLL_INTERVAL"])
        attempt.next_check_at = now + timedelta(seconds=poll)
    else:
        attempt.next_check_at = execution_next_check_at(checks=attempt.checks, now=now)
    attempt.job_ref = attempt.job_ref or job_ref
    attempt.save(update_fields=["checks", "next_check_at", "job_ref"])
    return _recheck_change(attempt, "still_unknown", reason_code, message=message[:500])


def execution_recheck_succeed(
    *,
    attempt: ExecutionAttempt,
    purchase_id: int,
    output: JobOutput,
    job_ref: str,
    payment: PaymentEvidence,
    retention: timedelta,
    now: datetime,
) -> Change:
    """The job finished after all: the attempt succeeds and its result and receipt are
    stored (the work ran once, under our idempotency key). Caller holds locks."""
    attempt.checks += 1
    attempt.succeed_on_recheck(job_ref=job_ref, at=now)
    attempt.save(update_fields=["state", "job_ref", "finished_at", "next_check_at", "checks"])
    _result_store(
        purchase_id=purchase_id,
        attempt=attempt,
        output=output,
        payment=payment,
        retention=retention,
        now=now,
    )
    digest = hashlib.sha256(output.content).hexdigest()
    return _recheck_change(
        attempt, "succeeded", "", sha256=digest, size=len(output.content), previous="unknown"
    )


def execution_recheck_fail(*, attempt: ExecutionAttempt, reason_code: str, now: datetime) -> Change:
    """The executor said for sure the work failed. Caller holds locks."""
    attempt.checks += 1
    attempt.fail_on_recheck(reason_code=reason_code, at=now)
    attempt.save(update_fields=["state", "reason_code", "finished_at", "next_check_at", "checks"])
    return _recheck_change(attempt, "failed", reason_code, previous="unknown")


def _recheck_change(
    attempt: ExecutionAttempt, outcome: str, reason_code: str, **evidence: Any
) -> Change:
    previous = evidence.pop("previous", attempt.state)
    next_check = attempt.next_check_at.isoformat() if attempt.next_check_at else None
    return Change(
        subject="execution_attempt.rechecked",  # purchases.event_subjects.EXECUTION_RECHECKED
        from_state=previous,
        to_state=attempt.state,
        reason_code=reason_code,
        evidence={
            "attempt": attempt.pk,
            "job_ref": attempt.job_ref,
            "check": attempt.checks,
            "outcome": outcome,
            "next_check_at": next_check,
            **evidence,
        },
    )
