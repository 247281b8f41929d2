"""An execution whose job service stays down ends escalated after a bounded number of tries,
counted in the database across retries, sweeps and worker restarts."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from doors.rest.prepaid_answers import PrepaidAnswers
from fulfillment.models import ExecutionAttempt
from payments.models import Refund
from purchases.models import Escalation, Purchase
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from purchases.services.fulfil.execution import (
    ExecutionOutcome,
    ExecutionRetryable,
    purchase_execute,
)
from purchases.services.quote.quotes import quote_create
from purchases.tasks import purchase_sweep_stalled_task
from tests.factories import OfferingFactory
from tests.integration.helpers import wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
TRIES = 3


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
    }


def paid_purchase(buyer) -> Purchase:
    offering = OfferingFactory.create(slug="word_stats", http_job=True)
    data = {"text": "the cat and the hat", "duration_ms": 100, "fail": False}
    quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=data).quote
    answer, _ = purchase_pay_prepaid(
        answers=PrepaidAnswers(),
        buyer=buyer,
        quote_id=quote.public_id,
        payment_id="execution-tries-key-01",
    )
    assert answer.status == 201, answer.body
    return Purchase.objects.get(ref=answer.purchase_ref)


def retry_events(purchase: Purchase) -> list[dict]:
    """Each retry under its own subject on the timeline, with its error (issue 10)."""
    events = purchase.events.filter(subject="execution_attempt.retried").order_by("pk")
    assert {event.reason_code for event in events} <= {"executor_retry"}
    return [event.evidence for event in events]


def assert_escalated_after(purchase: Purchase, tries: int, reason: str) -> None:
    purchase.refresh_from_db()
    assert purchase.fulfillment_state == "unknown"
    attempt = ExecutionAttempt.objects.get(purchase=purchase)
    assert (attempt.state, attempt.reason_code, attempt.tries) == ("unknown", reason, tries)
    escalation = Escalation.objects.get(purchase=purchase)
    assert (escalation.owner, escalation.state, escalation.reason_code) == (
        "support",
        "open",
        "execution_outcome_unknown",
    )
    assert escalation.details == {"execution_reason": reason}
    assert escalation.deadline_at - escalation.created_at == pytest.approx(
        timedelta(hours=4), abs=timedelta(seconds=5)
    )
    assert not Refund.objects.filter(purchase=purchase).exists()  # it may have run


def test_each_try_is_counted_and_on_the_timeline_then_support_decides(buyer, job_service):
    purchase = paid_purchase(buyer)
    job_service.stop()
    for expected_try in range(1, TRIES):
        with pytest.raises(ExecutionRetryable) as raised:
            purchase_execute(purchase_id=purchase.pk, worker="w")
        assert raised.value.tries == expected_try
    assert purchase_execute(purchase_id=purchase.pk, worker="w") == ExecutionOutcome.ESCALATED
    events = retry_events(purchase)
    assert [e["try"] for e in events] == [1, 2, 3]
    assert {e["error"] for e in events} == {"job_service_unavailable"}
    assert all("lookup failed" in e["message"] for e in events)
    assert [e["give_up"] for e in events] == ["", "", "execution_tries_exhausted"]
    assert_escalated_after(purchase, TRIES, "execution_tries_exhausted")
    # Another task arriving later finds nothing to run and starts no try.
    assert purchase_execute(purchase_id=purchase.pk, worker="late") == ExecutionOutcome.OBSERVED
    assert ExecutionAttempt.objects.get(purchase=purchase).tries == TRIES


def test_past_the_deadline_a_resumed_execution_escalates_without_a_new_try(buyer, job_service):
    purchase = paid_purchase(buyer)
    job_service.stop()
    with pytest.raises(ExecutionRetryable):
        purchase_execute(purchase_id=purchase.pk, worker="w1")
    # The worker died in its backoff; time moves past the deadline and the lease (not slept).
    past = timezone.now() - timedelta(hours=3)
    ExecutionAttempt.objects.filter(purchase=purchase).update(
        started_at=past, lease_expires_at=past
    )
    assert purchase_execute(purchase_id=purchase.pk, worker="w2") == ExecutionOutcome.ESCALATED
    assert [e["try"] for e in retry_events(purchase)] == [1]
    assert_escalated_after(purchase, 1, "execution_deadline_passed")


@pytest.mark.worker
def test_job_service_down_real_workers_and_sweeper_escalate_after_exactly_n_tries(
    buyer, job_service, start_worker
):
    limits = {"TOLLBOOTH_EXECUTION_MAX_TRIES": str(TRIES)}
    job_service.stop()
    purchase = paid_purchase(buyer)  # its task is enqueued on commit
    # A backoff that outlives the lease, as in production: the first worker waits it out.
    first = start_worker(
        "w1", extra_env={**limits, "TOLLBOOTH_EXECUTION_RETRY_BACKOFF_SECONDS": "600"}
    )
    wait_for(lambda: retry_events(purchase), timeout=60, message="the first try to fail")
    attempt = ExecutionAttempt.objects.get(purchase=purchase)
    assert attempt.tries == 1
    assert attempt.lease_expires_at > timezone.now() + timedelta(seconds=500)  # covers backoff
    first.kill()
    # The lease runs out (moved, not slept on); a new worker's sweeper sends a new task, whose
    # Celery retry count starts at 0 again. The database's count does not.
    ExecutionAttempt.objects.filter(pk=attempt.pk).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    start_worker("w2", extra_env={**limits, "TOLLBOOTH_EXECUTION_RETRY_BACKOFF_SECONDS": "0.1"})
    purchase_sweep_stalled_task.delay()
    wait_for(
        lambda: Escalation.objects.filter(purchase=purchase).exists(),
        timeout=90,
        message="the execution to escalate",
    )
    assert_escalated_after(purchase, TRIES, "execution_tries_exhausted")
    assert [e["try"] for e in retry_events(purchase)] == [1, 2, 3]
    assert purchase.events.filter(reason_code="lease_expired_taken_over").count() == 1
