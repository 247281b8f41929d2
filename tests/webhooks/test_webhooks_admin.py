"""The webhooks' admin (issue 33, part 1): admins keep endpoints, read deliveries and their
attempts, replay, send a test event, disable and enable; support and finance see none of it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from purchases.models import OutboxMessage
from tests.webhooks.receiver import Receiver
from webhooks.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookEvent
from webhooks.services import webhook_delivery_attempt, webhook_event_publish

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLBOOTH_TEST_WEBHOOK_SECRET", "whsec-admin-test-0123456789")


def _url(model: type[Any], view: str = "changelist", *args: Any) -> str:
    return reverse(f"admin:webhooks_{model._meta.model_name}_{view}", args=args)


def _add_endpoint(client: Client, url: str) -> Any:
    return client.post(
        _url(WebhookEndpoint, "add"),
        {
            "url": url,
            "description": "CRM",
            "event_types": ["purchase.paid", "webhook.test"],
            "secret_env": "TOLLBOOTH_TEST_WEBHOOK_SECRET",
            "key_id": "k1",
            "previous_secret_env": "",
            "previous_key_id": "",
        },
    )


def _act(client: Client, model: type[Any], action: str, pks: list[int]) -> Any:
    return client.post(_url(model), {"action": action, "_selected_action": [str(pk) for pk in pks]})


def test_an_admin_adds_an_endpoint_sends_a_test_event_and_reads_its_attempts(
    superuser: Client, receiver: Receiver
):
    receiver.status, receiver.answer = 503, b"<h1>Service Unavailable</h1>"
    assert _add_endpoint(superuser, receiver.url).status_code == 302
    endpoint = WebhookEndpoint.objects.get()
    assert (endpoint.event_types, endpoint.key_id, endpoint.enabled) == (
        ["purchase.paid", "webhook.test"],
        "k1",
        True,
    )

    assert _act(superuser, WebhookEndpoint, "send_test_event", [endpoint.pk]).status_code == 302
    event = WebhookEvent.objects.get(type="webhook.test")
    assert OutboxMessage.objects.get(job="webhook_event_publish").kwargs == {"event_id": event.pk}
    webhook_event_publish(event_id=event.pk)  # what the worker runs once the relay sends it
    assert json.loads(receiver.received[0].body)["id"] == event.public_id
    delivery = WebhookDelivery.objects.get()
    assert (delivery.state, delivery.last_status) == ("pending", 503)

    page = superuser.get(_url(WebhookEndpoint, "change", endpoint.pk))
    assert page.status_code == 200
    assert event.public_id in page.content.decode()
    detail = superuser.get(_url(WebhookDelivery, "change", delivery.pk)).content.decode()
    assert "Service Unavailable" in detail and "503" in detail
    listing = superuser.get(_url(WebhookEndpoint))
    assert listing.status_code == 200 and receiver.url in listing.content.decode()

    receiver.status = 200
    assert _act(superuser, WebhookDelivery, "replay_deliveries", [delivery.pk]).status_code == 302
    staged = OutboxMessage.objects.get(job="webhook_delivery_attempt")
    assert staged.kwargs == {"delivery_id": delivery.pk}
    assert webhook_delivery_attempt(delivery_id=delivery.pk) == "delivered"
    assert WebhookAttempt.objects.filter(delivery=delivery).count() == 2


def test_an_admin_disables_and_enables_an_endpoint(superuser: Client, receiver: Receiver):
    _add_endpoint(superuser, receiver.url)
    endpoint = WebhookEndpoint.objects.get()
    _act(superuser, WebhookEndpoint, "disable_endpoints", [endpoint.pk])
    endpoint.refresh_from_db()
    assert (endpoint.enabled, endpoint.disabled_reason) == (False, "disabled_by_staff")
    _act(superuser, WebhookEndpoint, "enable_endpoints", [endpoint.pk])
    endpoint.refresh_from_db()
    assert (endpoint.enabled, endpoint.disabled_reason) == (True, "")


def test_the_form_refuses_a_secret_in_place_of_its_variable(superuser: Client, settings):
    settings.WEBHOOKS = {**settings.WEBHOOKS, "REQUIRE_HTTPS": True}
    response = superuser.post(
        _url(WebhookEndpoint, "add"),
        {"url": "http://crm.example/hooks", "secret_env": "s3cr3t!", "key_id": "k1"},
    )
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert {"url", "secret_env"} <= set(errors)
    assert not WebhookEndpoint.objects.exists()


def test_support_and_finance_see_no_webhooks(
    superuser: Client, support: Client, finance: Client, receiver: Receiver
):
    _add_endpoint(superuser, receiver.url)
    endpoint = WebhookEndpoint.objects.get()
    for staff in (support, finance):
        for model in (WebhookEndpoint, WebhookDelivery, WebhookEvent):
            assert staff.get(_url(model)).status_code == 403, model
        assert staff.get(_url(WebhookEndpoint, "change", endpoint.pk)).status_code == 403
        forged = _act(staff, WebhookEndpoint, "disable_endpoints", [endpoint.pk])
        assert forged.status_code == 403
        assert _add_endpoint(staff, "http://evil.example/hooks").status_code == 403
    endpoint.refresh_from_db()
    assert endpoint.enabled
    assert WebhookEndpoint.objects.count() == 1
    assert not WebhookEvent.objects.exists()
