"""The job service goes down with paid work under way: while the outcome is unknown the buyer
hears "pending" on every door (never `409 execution_failed`), the execution keeps being
checked after it escalates, and once the service is back the work completes exactly once,
its result is delivered and the escalation closes itself (issue 18, item 2)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from doors.rest.prepaid_answers import PrepaidAnswers
from doors.x402.answers import x402_answer, x402_capability_answer
from fulfillment.models import ExecutionAttempt, Result
from payments.models import Refund
from purchases.models import Escalation, Purchase
from purchases.selectors import purchase_capability_token, purchase_capability_url
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from purchases.services.fulfil.execution import (
    ExecutionOutcome,
    ExecutionRetryable,
    purchase_execute,
)
from purchases.services.fulfil.execution_recheck import (
    RecheckOutcome,
    executions_recheck_due,
    purchase_execution_recheck,
)
from purchases.services.quote.quotes import quote_create
from purchases.services.x402.outcomes import x402_outcome_for_ref
from purchases.tasks import recheck_unknown_executions_task
from tests.factories import OfferingFactory, PurchaseFactory
from tests.fixtures.jobservice import JobServiceProcess, start_job_service
from tests.integration.helpers import race, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
TRIES = 2


@pytest.fixture
def job_service_url_env(job_service):
    return {"JOB_SERVICE_URL": job_service.url}


@pytest.fixture(autouse=True)
def _point_at_job_service(settings, job_service):
    settings.TOLLBOOTH = {
        **settings.TOLLBOOTH,
        "JOB_SERVICE_URL": job_service.url,
        "EXECUTION_MAX_TRIES": TRIES,
        "EXECUTION_RETRY_BACKOFF_SECONDS": 0.0,
        "EXECUTION_POLL_INTERVAL": 0.05,
    }


def restart(service: JobServiceProcess) -> JobServiceProcess:
    """The same service back on the same port and database (its jobs kept)."""
    port = int(service.url.rsplit(":", 1)[1])
    return start_job_service(db_path=service.db_path, port=port)


def paid_purchase(buyer, *, duration_ms: int, key: str) -> Purchase:
    offering = OfferingFactory.create(slug="word_stats", http_job=True)
    data = {"text": "the cat and the hat", "duration_ms": duration_ms, "fail": False}
    quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=data).quote
    answer, _ = purchase_pay_prepaid(
        answers=PrepaidAnswers(), buyer=buyer, quote_id=quote.public_id, payment_id=key
    )
    assert answer.status == 201, answer.body
    return Purchase.objects.get(ref=answer.purchase_ref)


def assert_buyer_hears_pending(client, purchase: Purchase) -> None:
    """Every door says pending, with a way to poll and when; never execution_failed."""
    result = client.get(f"/api/v1/purchases/{purchase.ref}/result")
    assert result.status_code == 202, result.content
    assert 2 <= int(result["Retry-After"]) <= 300
    body = result.json()
    assert body["execution"]["state"] == "unknown"
    assert body["execution"]["awaiting"] == "executor"
    assert body["execution"]["next_check_at"]
    assert (body["delivery"]["state"], body["next_action"]) == ("pending", "poll_result")
    detail = client.get(f"/api/v1/purchases/{purchase.ref}").json()
    assert (detail["delivery"]["state"], detail["next_action"]) == ("pending", "poll_result")
    status_url = client.get(purchase_capability_url(purchase=purchase))
    assert status_url.status_code == 202, status_url.content
    assert status_url["Location"] == purchase_capability_url(purchase=purchase)
    assert "Retry-After" in status_url
    token = purchase_capability_token(ref=purchase.ref)
    capability = x402_capability_answer(ref=purchase.ref, token=token)
    assert capability.status == 202
    # A resent payment to the paid URL is answered live from the purchase (X402Answers.render).
    paid_url = x402_answer(x402_outcome_for_ref(ref=purchase.ref))
    assert paid_url.status == 202 and paid_url.body["status_url"]  # type: ignore[index]


def assert_recovered_once(client, purchase: Purchase, service: JobServiceProcess) -> None:
    purchase.refresh_from_db()
    assert purchase.fulfillment_state == "succeeded"
    attempt = ExecutionAttempt.objects.get(purchase=purchase)
    assert (attempt.state, attempt.next_check_at) == ("succeeded", None)
    assert Result.objects.filter(purchase=purchase).count() == 1
    escalation = Escalation.objects.get(purchase=purchase)
    assert (escalation.state, escalation.resolution_code) == (
        "resolved",
        "execution_completed_on_recheck",
    )
    assert escalation.resolved_by == "recheck"
    assert purchase.events.filter(
        subject="escalation", to_state="resolved", actor_type="system"
    ).exists()
    assert not Refund.objects.filter(purchase=purchase).exists()
    delivered = client.get(f"/api/v1/purchases/{purchase.ref}/result")
    assert delivered.status_code == 200, delivered.content
    assert delivered.content == bytes(Result.objects.get(purchase=purchase).body) != b""
    stats = service.stats()
    assert stats["jobs_created"] == 1  # the paid work ran exactly once


def test_down_before_the_job_existed_buyer_pending_then_completes_once(
    buyer, client_for_buyer, job_service
):
    job_service.stop()
    purchase = paid_purchase(buyer, duration_ms=100, key="unknown-recovery-key-01")
    with pytest.raises(ExecutionRetryable):
        purchase_execute(purchase_id=purchase.pk, worker="w")
    assert purchase_execute(purchase_id=purchase.pk, worker="w") == ExecutionOutcome.ESCALATED
    attempt = ExecutionAttempt.objects.get(purchase=purchase)
    assert attempt.state == "unknown" and attempt.job_ref == ""
    assert attempt.next_check_at is not None  # not forgotten: its next check is recorded
    assert_buyer_hears_pending(client_for_buyer, purchase)
    # Still down at the first check: counted, on the timeline, the next one later.
    assert purchase_execution_recheck(purchase_id=purchase.pk) == RecheckOutcome.STILL_UNKNOWN
    attempt.refresh_from_db()
    first_wait = attempt.next_check_at
    assert attempt.checks == 1 and first_wait > timezone.now() + timedelta(seconds=90)
    assert_buyer_hears_pending(client_for_buyer, purchase)
    service = restart(job_service)
    try:
        # The check is due (time moved, not slept on): the sweep stages it; run it here.
        due = timezone.now() + timedelta(hours=1)
        assert executions_recheck_due(now=due)["staged"] == 1
        assert executions_recheck_due(now=due)["staged"] == 0  # held while staged
        outcome = purchase_execution_recheck(purchase_id=purchase.pk)
        if outcome == RecheckOutcome.STILL_UNKNOWN:  # the job was created by that check
            wait_for(lambda: service.stats()["jobs_created"] == 1, message="the job")
            attempt.refresh_from_db()
            assert attempt.job_ref  # the job ref learned by the check is saved
            outcome = wait_for(
                lambda: (
                    o
                    if (o := purchase_execution_recheck(purchase_id=purchase.pk))
                    != RecheckOutcome.STILL_UNKNOWN
                    else None
                ),
                interval=0.1,
                message="the job to finish",
            )
        assert outcome == RecheckOutcome.SUCCEEDED
        assert_recovered_once(client_for_buyer, purchase, service)
        rechecks = purchase.events.filter(subject="execution_attempt.rechecked")
        last_check = rechecks.last()
        assert last_check is not None and last_check.evidence["outcome"] == "succeeded"
        # A late check finds nothing left to do.
        assert purchase_execution_recheck(purchase_id=purchase.pk) == RecheckOutcome.OBSERVED
    finally:
        service.stop()


def test_a_job_the_service_reports_running_is_polled_again_soon_not_at_the_backoff(
    buyer, job_service
):
    """Once the service is back and says the job runs, the next check is a poll away, not
    the backoff the outage grew (issue 33: a 200 ms job's result reached the buyer about
    22 minutes after the service returned)."""
    job_service.stop()
    purchase = paid_purchase(buyer, duration_ms=3_000, key="unknown-recovery-key-09")
    with pytest.raises(ExecutionRetryable):
        purchase_execute(purchase_id=purchase.pk, worker="w")
    assert purchase_execute(purchase_id=purchase.pk, worker="w") == ExecutionOutcome.ESCALATED
    for _ in range(4):  # checks while the service is down: the backoff grows
        assert purchase_execution_recheck(purchase_id=purchase.pk) == RecheckOutcome.STILL_UNKNOWN
    attempt = ExecutionAttempt.objects.get(purchase=purchase)
    assert attempt.next_check_at > timezone.now() + timedelta(minutes=15)
    service = restart(job_service)
    try:
        # This check starts the job (the purchase's own key); the service says it runs.
        assert purchase_execution_recheck(purchase_id=purchase.pk) == RecheckOutcome.STILL_UNKNOWN
        attempt.refresh_from_db()
        assert attempt.job_ref
        assert attempt.next_check_at <= timezone.now() + timedelta(seconds=1)
        due = timezone.now() + timedelta(seconds=1)
        assert executions_recheck_due(now=due)["staged"] == 1  # the next sweep takes it
    finally:
        service.stop()


def test_a_definitive_failure_on_recheck_is_failed_and_refunded(buyer, job_service):
    job_service.stop()
    offering = OfferingFactory.create(slug="word_stats", http_job=True)
    data = {"text": "x", "duration_ms": 0, "fail": True}
    quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=data).quote
    answer, _ = purchase_pay_prepaid(
        answers=PrepaidAnswers(),
        buyer=buyer,
        quote_id=quote.public_id,
        payment_id="unknown-recovery-key-02",
    )
    purchase = Purchase.objects.get(ref=answer.purchase_ref)
    with pytest.raises(ExecutionRetryable):
        purchase_execute(purchase_id=purchase.pk, worker="w")
    assert purchase_execute(purchase_id=purchase.pk, worker="w") == ExecutionOutcome.ESCALATED
    service = restart(job_service)
    try:
        outcome = wait_for(
            lambda: (
                o
                if (o := purchase_execution_recheck(purchase_id=purchase.pk))
                != RecheckOutcome.STILL_UNKNOWN
                else None
            ),
            interval=0.1,
            message="the job's definitive answer",
        )
        assert outcome == RecheckOutcome.FAILED
        purchase.refresh_from_db()
        assert (purchase.fulfillment_state, purchase.reason_code) == ("failed", "job_failed")
        unknown = Escalation.objects.get(purchase=purchase, reason_code="execution_outcome_unknown")
        assert unknown.resolution_code == "execution_failed_on_recheck"
        assert Refund.objects.filter(purchase=purchase, reason_code="execution_failed").count() == 1
        assert service.stats()["jobs_created"] == 1
    finally:
        service.stop()


@pytest.mark.worker
def test_service_down_mid_job_real_worker_buyer_pending_then_delivered_once(
    buyer, client_for_buyer, job_service, start_worker
):
    """The issue's outage: the job was created, then the service went away; the worker spent
    its tries and escalated. The buyer heard pending throughout; after the restart the
    beat's sweep (run here as its task) stages a check on the worker, which finds the job
    done: stored, delivered, escalation closed, one job."""
    start_worker(
        "w1",
        extra_env={
            "TOLLBOOTH_EXECUTION_MAX_TRIES": str(TRIES),
            "TOLLBOOTH_EXECUTION_RETRY_BACKOFF_SECONDS": "0.1",
            "TOLLBOOTH_EXECUTION_POLL_SECONDS": "0.05",
        },
    )
    purchase = paid_purchase(buyer, duration_ms=3000, key="unknown-recovery-key-03")
    wait_for(
        lambda: ExecutionAttempt.objects.filter(purchase=purchase).exclude(job_ref="").exists(),
        timeout=60,
        message="the job to be created",
    )
    job_service.stop()
    wait_for(
        lambda: Escalation.objects.filter(purchase=purchase).exists(),
        timeout=90,
        message="the execution to escalate as unknown",
    )
    purchase.refresh_from_db()
    assert purchase.fulfillment_state == "unknown"
    for _ in range(3):  # the buyer keeps polling while the service is down
        assert_buyer_hears_pending(client_for_buyer, purchase)
    service = restart(job_service)
    try:
        # The job runs on the service's clock through the outage; the check below should
        # find it done (the "still running" answer is the other test's case).
        job_ref = ExecutionAttempt.objects.get(purchase=purchase).job_ref
        wait_for(
            # The fixture's own opener: no proxy from the environment in the way.
            lambda: service._call("GET", f"/jobs/{job_ref}")["status"] == "succeeded",
            message="the job to finish on the service",
        )
        ExecutionAttempt.objects.filter(purchase=purchase).update(
            next_check_at=timezone.now() - timedelta(seconds=1)
        )  # its next check is due (time moved, not slept on)
        recheck_unknown_executions_task.delay()
        wait_for(
            lambda: Purchase.objects.filter(pk=purchase.pk, fulfillment_state="succeeded").exists(),
            timeout=60,
            message="the check to find the work done",
        )
        assert_recovered_once(client_for_buyer, purchase, service)
        assert service.stats()["replayed"] == 0  # the check polled the saved job: no start
    finally:
        service.stop()


def test_checks_stop_once_the_purchase_is_no_longer_unknown(buyer):
    """A stale unknown attempt under a purchase that moved on is not checked forever."""
    purchase = PurchaseFactory.create(executed=True, prepaid=True)
    now = timezone.now()
    ExecutionAttempt.objects.create(
        purchase=purchase,
        executor="http_job",
        worker="w",
        lease_token="t",
        lease_expires_at=now,
        job_idempotency_key=f"tollbooth-{purchase.ref}",
        started_at=now,
        state="unknown",
        next_check_at=now - timedelta(seconds=1),
    )
    assert executions_recheck_due(now=now)["staged"] == 1
    assert purchase_execution_recheck(purchase_id=purchase.pk) == RecheckOutcome.OBSERVED
    assert ExecutionAttempt.objects.get(purchase=purchase).next_check_at is None
    assert executions_recheck_due(now=now + timedelta(hours=1))["staged"] == 0


def test_two_checks_at_once_start_one_job_and_store_one_result(buyer, job_service):
    """The sweep's check and staff's "Reconcile execution now" racing: the job service's own
    key gives one job; the purchase's lock lets one of them record it."""
    job_service.stop()
    purchase = paid_purchase(buyer, duration_ms=0, key="unknown-recovery-key-05")
    with pytest.raises(ExecutionRetryable):
        purchase_execute(purchase_id=purchase.pk, worker="w")
    assert purchase_execute(purchase_id=purchase.pk, worker="w") == ExecutionOutcome.ESCALATED
    service = restart(job_service)
    try:
        outcomes = race(2, lambda i: purchase_execution_recheck(purchase_id=purchase.pk))
        assert sorted(outcomes) == [RecheckOutcome.OBSERVED, RecheckOutcome.SUCCEEDED]
        assert service.stats()["jobs_created"] == 1
        assert Result.objects.filter(purchase=purchase).count() == 1
        assert purchase.events.filter(subject="execution_attempt.rechecked").count() == 1
    finally:
        service.stop()
