"""A slow endpoint never delays another's deliveries (docs/webhooks.md, "Delivery"): each
endpoint is sent to in its own lane (a thread), and a lane held by one sweep is skipped by
the others, which send to the rest at once. Real threads and real connections."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections

from tests.integration.helpers import wait_for
from tests.webhooks.receiver import Receiver, serving
from tests.webhooks.test_webhooks import SECRET, endpoint, pay
from webhooks import events as webhook_events
from webhooks.models import WebhookDelivery, WebhookEndpoint, WebhookEvent
from webhooks.services import _publish_only as publish_only
from webhooks.services import webhook_deliveries_send_due, webhook_event_publish

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
# Under the tests' 1 s read timeout: the slow endpoint answers, slowly.
SLOW_SECONDS = 0.8


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLBOOTH_TEST_WEBHOOK_SECRET", SECRET)
    webhook_events.subscriptions_forget()


def _events(buyer, count: int) -> list[WebhookEvent]:
    purchases = [pay(buyer, key=f"lanes-test-key-{n:05d}") for n in range(count)]
    return [WebhookEvent.objects.get(purchase=p, type="purchase.paid") for p in purchases]


def test_the_sweep_sends_to_a_fast_endpoint_while_a_slow_one_is_still_answering(
    buyer, receiver: Receiver
):
    receiver.delay_seconds = SLOW_SECONDS
    with serving() as fast:
        endpoint(receiver.url, event_types=["purchase.paid"])
        endpoint(fast.url, event_types=["purchase.paid"])
        for event in _events(buyer, 4):
            publish_only(event.pk, event.occurred_at)  # pending and due, none tried yet

        started = time.monotonic()
        assert webhook_deliveries_send_due() == 8
        took = time.monotonic() - started

        assert len(fast.received) == 4 and len(receiver.received) == 4
        # The fast endpoint had all four before the slow one had answered its first.
        assert max(r.at for r in fast.received) - started < SLOW_SECONDS
        assert took >= 4 * SLOW_SECONDS  # the slow lane's four, one after another
    assert set(WebhookDelivery.objects.values_list("state", flat=True)) == {"delivered"}


def test_a_lane_held_by_one_sweep_is_skipped_by_the_next_which_sends_the_rest(
    buyer, receiver: Receiver
):
    receiver.delay_seconds = SLOW_SECONDS
    with serving() as fast:
        slow_endpoint = endpoint(receiver.url, event_types=["purchase.paid"])
        endpoint(fast.url, event_types=["purchase.paid"])
        first, *later = _events(buyer, 4)
        for event in later:
            publish_only(event.pk, event.occurred_at)

        def sweep() -> None:
            try:
                webhook_deliveries_send_due()
            finally:
                connections.close_all()

        busy = threading.Thread(target=sweep)
        busy.start()  # holds the slow lane for about 3 x SLOW_SECONDS
        wait_for(
            lambda: (
                len(fast.received) == 3
                and list(WebhookEndpoint.objects.filter(lane_until__isnull=False))
                == [slow_endpoint]
            ),
            message="the first sweep done with the fast endpoint, holding the slow one's lane",
        )
        started = time.monotonic()
        webhook_event_publish(event_id=first.pk)  # a new event, while the slow lane is busy
        took = time.monotonic() - started
        assert took < SLOW_SECONDS  # it did not wait for the slow lane
        assert first.public_id.encode() in b"".join(r.body for r in fast.received)
        busy.join(timeout=30)
        # What the second skipped, the sweep holding the lane sent (or the next sweep does).
        webhook_deliveries_send_due()
    assert WebhookDelivery.objects.filter(state="delivered").count() == 8
    assert WebhookEndpoint.objects.filter(lane_until__isnull=False).count() == 0
