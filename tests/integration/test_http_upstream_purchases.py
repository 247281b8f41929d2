"""Purchases whose offering runs on a seller's signed HTTP upstream (a real process): the
result is stored once, a declared 4xx is refunded, an answer over the cap escalates, and the
upstream's own count shows one effect per purchase every time."""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal

import pytest

from doors.rest.prepaid_answers import PrepaidAnswers
from fulfillment.models import ExecutionAttempt, Result, Upstream
from payments.models import Refund
from purchases.models import Escalation, Purchase, PurchaseEvent
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from purchases.services.fulfil.execution import (
    ExecutionOutcome,
    ExecutionRetryable,
    purchase_execute,
)
from purchases.services.quote.quotes import quote_create
from tests.factories import OfferingFactory
from tests.fixtures.sample_upstream import SECRET_ENV, SampleUpstream

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
OPEN_SCHEMA = {"type": "object"}


@pytest.fixture(autouse=True)
def _fast_retries(settings):
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "EXECUTION_RETRY_BACKOFF_SECONDS": 0.0}


def paid_purchase(buyer, upstream: SampleUpstream, data: dict, **config: object) -> Purchase:
    offering = OfferingFactory.create(executor="http", input_schema=OPEN_SCHEMA, volatile_fields=[])
    fields = {"timeout_seconds": 2, "definitive_statuses": [422], "max_result_bytes": 4096}
    Upstream.objects.create(
        offering=offering,
        kind="http",
        url=upstream.url + "/work",
        secret_env=SECRET_ENV,
        **{**fields, **config},
    )
    quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=data).quote
    answer, _ = purchase_pay_prepaid(
        answers=PrepaidAnswers(),
        buyer=buyer,
        quote_id=quote.public_id,
        payment_id="upstream-purchase-key-01",
    )
    assert answer.status in (201, 202), answer.body
    return Purchase.objects.get(ref=answer.purchase_ref)


def run_until_done(purchase: Purchase, limit: int = 5) -> tuple[ExecutionOutcome, int]:
    """What the Celery task does: run, and run again after each retryable answer."""
    for retries in range(limit):
        try:
            return purchase_execute(purchase_id=purchase.pk, worker="w1"), retries
        except ExecutionRetryable:
            continue
    raise AssertionError("still retrying")


def test_5xx_then_2xx_stores_the_one_result(buyer, sample_upstream: SampleUpstream) -> None:
    purchase = paid_purchase(buyer, sample_upstream, {"q": "a", "fail_times": 2})
    outcome, retries = run_until_done(purchase)
    assert (outcome, retries) == (ExecutionOutcome.SUCCEEDED, 2)
    result = Result.objects.get(purchase=purchase)
    assert result.content_type == "application/json"
    body = json.loads(bytes(result.body))
    assert body["key"] == f"tollbooth-{purchase.ref}"
    assert sample_upstream.stats()["effects"] == 1
    attempt = ExecutionAttempt.objects.get(purchase=purchase)
    assert (attempt.executor, attempt.tries) == ("http", 3)


def test_a_declared_4xx_fails_and_refunds(buyer, sample_upstream: SampleUpstream) -> None:
    purchase = paid_purchase(buyer, sample_upstream, {"q": "b", "reject": 422})
    assert run_until_done(purchase) == (ExecutionOutcome.FAILED, 0)
    purchase.refresh_from_db()
    assert purchase.fulfillment_state == "failed"
    assert Refund.objects.filter(purchase=purchase).exists()
    assert sample_upstream.stats()["effects"] == 0


def test_an_answer_over_the_cap_escalates_without_a_refund(
    buyer, sample_upstream: SampleUpstream
) -> None:
    purchase = paid_purchase(buyer, sample_upstream, {"q": "c", "size": 10_000})
    assert run_until_done(purchase) == (ExecutionOutcome.ESCALATED, 0)
    purchase.refresh_from_db()
    assert (purchase.fulfillment_state, purchase.reason_code) == (
        "unknown",
        "upstream_result_too_large",
    )
    assert Escalation.objects.filter(purchase=purchase, state="open").exists()
    assert not Refund.objects.filter(purchase=purchase).exists()
    assert not Result.objects.filter(purchase=purchase).exists()
    assert sample_upstream.stats()["effects"] == 1


def test_slow_past_the_timeout_is_retried_with_the_same_key_until_the_offerings_deadline(
    buyer, sample_upstream: SampleUpstream, settings
) -> None:
    # The deployment would go on for 50 tries and two hours; this offering gives up after 1 s.
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "EXECUTION_MAX_TRIES": 50}
    purchase = paid_purchase(
        buyer,
        sample_upstream,
        {"q": "slow", "slow": 0.6},
        timeout_seconds=Decimal("0.2"),
        deadline_seconds=1,
    )
    outcome, retries = run_until_done(purchase, limit=20)
    assert outcome == ExecutionOutcome.ESCALATED
    purchase.refresh_from_db()
    assert (purchase.fulfillment_state, purchase.reason_code) == (
        "unknown",
        "execution_deadline_passed",
    )
    attempt = ExecutionAttempt.objects.get(purchase=purchase)
    assert 2 <= attempt.tries < 50 and retries == attempt.tries - 1
    # Every try was the same signed call with the same key: one effect, the rest repeats.
    stats = sample_upstream.stats()
    assert (stats["effects"], stats["calls"], stats["replayed"]) == (1, attempt.tries, retries)
    retried = PurchaseEvent.objects.filter(purchase=purchase, subject="execution_attempt.retried")
    budget = {(e.evidence["max_tries"], e.evidence["deadline_at"]) for e in retried}
    assert budget == {(50, (attempt.started_at + timedelta(seconds=1)).isoformat())}
    assert Escalation.objects.filter(purchase=purchase, state="open").exists()
    assert not Refund.objects.filter(purchase=purchase).exists()  # unknown is not failed


def test_the_offerings_max_tries_bounds_the_retries(buyer, sample_upstream: SampleUpstream) -> None:
    # 503 five times after the effect: the deployment's eight tries would reach the answer.
    purchase = paid_purchase(buyer, sample_upstream, {"q": "d", "fail_times": 5}, max_tries=2)
    assert run_until_done(purchase) == (ExecutionOutcome.ESCALATED, 1)
    purchase.refresh_from_db()
    assert purchase.reason_code == "execution_tries_exhausted"
    assert ExecutionAttempt.objects.get(purchase=purchase).tries == 2
    assert not Result.objects.filter(purchase=purchase).exists()
    assert sample_upstream.stats()["effects"] == 1
