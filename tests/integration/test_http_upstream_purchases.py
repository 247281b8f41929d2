"""Purchases whose offering runs on a seller's signed HTTP upstream (a real process): the
result is stored once, a declared 4xx is refunded, an answer over the cap escalates, and the
upstream's own count shows one effect per purchase every time."""

from __future__ import annotations

import json

import pytest

from fulfillment.models import ExecutionAttempt, Result, Upstream
from payments.models import Refund
from purchases.api.prepaid_answers import PrepaidAnswers
from purchases.models import Escalation, Purchase
from purchases.services.execution import ExecutionOutcome, ExecutionRetryable, purchase_execute
from purchases.services.prepaid_checkout import purchase_pay_prepaid
from purchases.services.quotes import quote_create
from tests.factories import OfferingFactory
from tests.fixtures.sample_upstream import SECRET_ENV, SampleUpstream

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
OPEN_SCHEMA = {"type": "object"}


@pytest.fixture(autouse=True)
def _fast_retries(settings):
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "EXECUTION_RETRY_BACKOFF_SECONDS": 0.0}


def paid_purchase(buyer, upstream: SampleUpstream, data: dict, **config: object) -> Purchase:
    offering = OfferingFactory.create(executor="http", input_schema=OPEN_SCHEMA, volatile_fields=[])
    Upstream.objects.create(
        offering=offering,
        kind="http",
        url=upstream.url + "/work",
        timeout_seconds=2,
        secret_env=SECRET_ENV,
        definitive_statuses=[422],
        max_result_bytes=4096,
        **config,
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
