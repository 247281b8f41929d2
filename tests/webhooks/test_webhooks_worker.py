"""End to end with a real Celery worker and beat (issue 33, part 1): a prepaid purchase's
events reach a real endpoint from the worker, in sequence, signed as documented, while the
purchase itself never waited on the endpoint."""

from __future__ import annotations

import json
import time

import pytest

from purchases.models import Purchase
from tests.integration.helpers import wait_for
from tests.webhooks.receiver import Receiver
from tests.webhooks.test_webhooks import SECRET, documented_verifier, endpoint, pay
from webhooks.models import WebhookDelivery

pytestmark = [pytest.mark.postgres, pytest.mark.worker, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLBOOTH_TEST_WEBHOOK_SECRET", SECRET)


def test_the_worker_delivers_a_purchases_events_in_sequence(
    buyer, receiver: Receiver, start_worker
):
    receiver.delay_seconds = 0.5  # slow, and the purchase does not wait for it
    endpoint(receiver.url, event_types=["purchase.paid", "purchase.succeeded"])
    start_worker("hooks", beat=True)
    started = time.monotonic()
    purchase = pay(buyer, key="webhook-worker-key-0001")
    assert time.monotonic() - started < 0.5

    wait_for(
        lambda: WebhookDelivery.objects.filter(state="delivered").count() == 2,
        timeout=60,
        message="both events delivered by the worker",
    )
    purchase = Purchase.objects.get(pk=purchase.pk)
    assert purchase.fulfillment_state == "succeeded"
    bodies = sorted((json.loads(r.body) for r in receiver.received), key=lambda b: b["sequence"])
    assert [(b["type"], b["sequence"]) for b in bodies] == [
        ("purchase.paid", 1),
        ("purchase.succeeded", 2),
    ]
    assert {b["purchase"] for b in bodies} == {purchase.ref}
    verify = documented_verifier()
    assert all(
        verify(r.headers["Tollbooth-Signature"], r.body, {"k2": SECRET.encode()})
        for r in receiver.received
    )
