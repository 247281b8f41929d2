"""Operating webhooks (issue 33, part 1): metrics for deliveries, failures and the backlog's
age, and a person told once when an endpoint has failed for an hour."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core import mail
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from backoffice import metrics
from tests.webhooks.receiver import Receiver, dead_url
from tests.webhooks.test_webhooks import SECRET, endpoint, pay
from webhooks.models import WebhookEndpoint, WebhookEvent
from webhooks.services import (
    webhook_deliveries_send_due,
    webhook_event_publish,
    webhook_failing_alert,
)

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch, settings) -> None:
    monkeypatch.setenv("TOLLBOOTH_TEST_WEBHOOK_SECRET", SECRET)
    settings.ADMINS = [("Ops", "ops@example.test")]
    settings.TOLLBOOTH_ALERT_BACKENDS = ["mail"]


def _samples(client) -> dict[tuple[str, tuple], float]:
    body = client.get("/metrics").content.decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def test_an_endpoint_failing_for_an_hour_is_told_once_and_shows_in_the_metrics(
    buyer, client, receiver: Receiver, monkeypatch
):
    dead = endpoint(dead_url())
    live = endpoint(receiver.url)
    start = timezone.now()
    event = WebhookEvent.objects.get(purchase=pay(buyer))
    webhook_event_publish(event_id=event.pk, now=start)
    dead.refresh_from_db()
    assert dead.failing_since == start

    later = start + timedelta(minutes=59)
    monkeypatch.setattr(metrics.tollbooth_collector, "clock", lambda: later)
    samples = _samples(client)
    assert samples[("tollbooth_webhook_deliveries", (("state", "pending"),))] == 1.0
    assert samples[("tollbooth_webhook_deliveries", (("state", "delivered"),))] == 1.0
    assert samples[("tollbooth_webhook_deliveries", (("state", "failed"),))] == 0.0
    # From the delivery row's creation, a moment after `start`.
    assert 58 * 60 < samples[("tollbooth_webhook_oldest_pending_age_seconds", ())] <= 59 * 60
    assert samples[("tollbooth_webhook_endpoints_failing", ())] == 0.0
    assert webhook_failing_alert(now=later) == 0  # not an hour yet
    assert mail.outbox == []

    an_hour = start + timedelta(hours=1, seconds=1)
    webhook_deliveries_send_due(now=an_hour)  # still refused
    assert webhook_failing_alert(now=an_hour) == 1
    assert webhook_failing_alert(now=an_hour + timedelta(minutes=5)) == 0  # once a spell
    [told] = mail.outbox
    assert "webhook_endpoint_failing" in told.subject and dead.url in told.body
    monkeypatch.setattr(metrics.tollbooth_collector, "clock", lambda: an_hour)
    assert _samples(client)[("tollbooth_webhook_endpoints_failing", ())] == 1.0
    live.refresh_from_db()
    assert live.failing_since is None


def test_a_2xx_ends_the_failing_spell(buyer, receiver: Receiver):
    hook = endpoint(receiver.url)
    receiver.status = 500
    start = timezone.now()
    event = WebhookEvent.objects.get(purchase=pay(buyer))
    webhook_event_publish(event_id=event.pk, now=start)
    assert webhook_failing_alert(now=start + timedelta(hours=2)) == 1
    receiver.status = 200
    webhook_deliveries_send_due(now=start + timedelta(hours=2))
    hook.refresh_from_db()
    assert (hook.failing_since, hook.failing_alerted_at) == (None, None)
    assert WebhookEndpoint.objects.get(pk=hook.pk).enabled
