"""One execution per purchase, whatever races or dies: real job service, threads and workers."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from doors.rest.prepaid_answers import PrepaidAnswers
from fulfillment.executors import JobSpec
from fulfillment.executors.http_job import HttpJobExecutor
from fulfillment.models import ExecutionAttempt, Receipt, Result
from payments.models import LedgerEntry, Refund
from payments.services import ledger_balance
from purchases.models import Escalation, Purchase
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from purchases.services.fulfil.execution import (
    ExecutionOutcome,
    ExecutionRetryable,
    purchase_execute,
    purchase_execution_give_up,
)
from purchases.services.quote.quotes import quote_create
from purchases.tasks import purchase_execute_task, purchase_sweep_stalled_task
from tests.factories import USDC_LOCAL, OfferingFactory
from tests.integration.helpers import wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
FUNDS = 10_000_000


@pytest.fixture
def job_service_url_env(job_service):
    return {"JOB_SERVICE_URL": job_service.url}


@pytest.fixture(autouse=True)
def _point_at_job_service(settings, job_service):
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "JOB_SERVICE_URL": job_service.url}


def paid_purchase(buyer, *, duration_ms=300, fail=False, escalate=False, key="exec-test-key-0001"):
    offering = OfferingFactory.create(slug="word_stats", http_job=True, escalating=escalate)
    data = {"text": "the cat and the hat", "duration_ms": duration_ms, "fail": fail}
    quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=data).quote
    answer, _ = purchase_pay_prepaid(
        answers=PrepaidAnswers(), buyer=buyer, quote_id=quote.public_id, payment_id=key
    )
    assert answer.status == 201, answer.body
    return Purchase.objects.get(ref=answer.purchase_ref)


def test_two_workers_racing_in_threads_run_the_job_once(buyer, job_service):
    purchase = paid_purchase(buyer, duration_ms=800)
    outcomes: list[ExecutionOutcome] = []
    barrier = threading.Barrier(2)

    def run(name: str) -> None:
        barrier.wait()
        try:
            outcomes.append(purchase_execute(purchase_id=purchase.pk, worker=name))
        finally:
            connection.close()  # each thread has its own connection; leave none behind

    threads = [threading.Thread(target=run, args=(f"thread-{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes) == [ExecutionOutcome.OBSERVED, ExecutionOutcome.SUCCEEDED]
    assert job_service.stats()["jobs_created"] == 1
    assert ExecutionAttempt.objects.filter(purchase=purchase).count() == 1
    assert Result.objects.filter(purchase=purchase).count() == 1


@pytest.mark.worker
def test_two_real_workers_race_for_one_execution(buyer, job_service, start_worker):
    purchase = paid_purchase(buyer, duration_ms=1500)
    first, second = start_worker("w1"), start_worker("w2")
    # The on_commit enqueue already sent one message; send a second to force the race.
    purchase_execute_task.delay(purchase_id=purchase.pk)
    wait_for(
        lambda: Purchase.objects.get(pk=purchase.pk).fulfillment_state == "succeeded",
        timeout=60,
        message="the execution to finish",
    )
    wait_for(
        lambda: "'observed'" in first.log() + second.log(),
        timeout=30,
        message="the losing worker to observe",
    )
    assert job_service.stats() == {"jobs_created": 1, "create_requests": 1, "replayed": 0}
    attempt = ExecutionAttempt.objects.get(purchase=purchase)
    assert attempt.takeovers == 0
    assert Result.objects.filter(purchase=purchase).count() == 1


@pytest.mark.worker
def test_worker_killed_mid_execution_resumes_from_the_job_ref(buyer, job_service, start_worker):
    purchase = paid_purchase(buyer, duration_ms=4000)
    doomed = start_worker("doomed")
    attempt = wait_for(
        lambda: ExecutionAttempt.objects.filter(purchase=purchase).exclude(job_ref="").first(),
        timeout=30,
        message="the job ref to be saved",
    )
    doomed.kill()
    assert Purchase.objects.get(pk=purchase.pk).fulfillment_state == "running"
    # Let the lease run out (moved, not slept on), then let the sweeper find it.
    ExecutionAttempt.objects.filter(pk=attempt.pk).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    start_worker("rescuer")
    purchase_sweep_stalled_task.delay()
    wait_for(
        lambda: Purchase.objects.get(pk=purchase.pk).fulfillment_state == "succeeded",
        timeout=60,
        message="the rescuer to finish",
    )
    attempt.refresh_from_db()
    assert attempt.takeovers == 1
    assert attempt.job_ref  # the same job, polled, never started again
    assert job_service.stats() == {"jobs_created": 1, "create_requests": 1, "replayed": 0}
    assert Result.objects.filter(purchase=purchase).count() == 1
    assert Receipt.objects.filter(purchase=purchase).count() == 1
    assert LedgerEntry.objects.filter(buyer=buyer, kind="purchase_debit").count() == 1
    assert purchase.events.filter(reason_code="lease_expired_taken_over").count() == 1


def test_job_created_but_not_recorded_is_found_not_duplicated(buyer, job_service):
    purchase = paid_purchase(buyer, duration_ms=100)
    # The crash window: the job service has the job, our database has no job ref.
    spec = JobSpec(
        purchase_ref=purchase.ref,
        operation="word_stats",
        input=purchase.quote.canonical_input,
        idempotency_key=f"tollbooth-{purchase.ref}",
    )
    orphan = HttpJobExecutor().start(spec)
    assert (
        purchase_execute(purchase_id=purchase.pk, worker="after-crash")
        == ExecutionOutcome.SUCCEEDED
    )
    assert ExecutionAttempt.objects.get(purchase=purchase).job_ref == orphan.job_ref
    assert job_service.stats() == {"jobs_created": 1, "create_requests": 2, "replayed": 1}


def test_failed_job_refunds_the_prepaid_balance(buyer, job_service):
    purchase = paid_purchase(buyer, fail=True)
    assert ledger_balance(buyer_id=buyer.pk, asset=USDC_LOCAL) == FUNDS - 250_000
    assert purchase_execute(purchase_id=purchase.pk, worker="w") == ExecutionOutcome.FAILED
    purchase.refresh_from_db()
    assert purchase.fulfillment_state == "failed"
    assert purchase.reason_code == "job_failed"
    refund = Refund.objects.get(purchase=purchase)
    assert (refund.state, refund.method, refund.amount) == ("paid", "ledger_credit", 250_000)
    assert ledger_balance(buyer_id=buyer.pk, asset=USDC_LOCAL) == FUNDS
    assert not Result.objects.filter(purchase=purchase).exists()


def test_failed_job_on_an_escalating_offering_opens_an_escalation(buyer, job_service):
    purchase = paid_purchase(buyer, fail=True, escalate=True)
    assert purchase_execute(purchase_id=purchase.pk, worker="w") == ExecutionOutcome.FAILED
    escalation = Escalation.objects.get(purchase=purchase)
    assert (escalation.owner, escalation.reason_code, escalation.state) == (
        "support",
        "execution_failed",
        "open",
    )
    assert escalation.deadline_at > timezone.now()
    assert not Refund.objects.filter(purchase=purchase).exists()


def test_unreachable_job_service_is_unknown_not_failed(buyer, job_service):
    purchase = paid_purchase(buyer)
    job_service.set_faults(fail_next=100, fail_status=503)
    with pytest.raises(ExecutionRetryable):
        purchase_execute(purchase_id=purchase.pk, worker="w")
    purchase.refresh_from_db()
    assert purchase.fulfillment_state == "running"
    assert not Refund.objects.exists()
    # Every retry spent: the effect is unknown, so support decides; nothing is refunded blindly.
    purchase_execution_give_up(
        purchase_id=purchase.pk, worker="w", reason_code="job_service_unavailable"
    )
    purchase.refresh_from_db()
    assert purchase.fulfillment_state == "unknown"
    assert Escalation.objects.get(purchase=purchase).reason_code == "execution_outcome_unknown"
    assert not Refund.objects.exists()
    assert ledger_balance(buyer_id=buyer.pk, asset=USDC_LOCAL) == FUNDS - 250_000
