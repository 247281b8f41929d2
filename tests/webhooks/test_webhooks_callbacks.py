"""A buyer's callback URL per API key, the URL guard every webhook goes through, and pruning
(docs/webhooks.md; issue 33, part 1)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from purchases.models import Buyer
from purchases.services.shared.buyers import api_key_issue
from tests.conftest import fund
from tests.factories import BuyerFactory
from tests.webhooks.receiver import Receiver, serving
from tests.webhooks.test_webhooks import SECRET, documented_verifier, endpoint, pay
from webhooks import events as webhook_events
from webhooks.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookEvent
from webhooks.services import (
    Outcome,
    webhook_deliveries_prune,
    webhook_delivery_attempt,
    webhook_event_publish,
)

pytestmark = pytest.mark.django_db
URL = reverse("api:webhook-callback")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLBOOTH_TEST_WEBHOOK_SECRET", SECRET)
    webhook_events.subscriptions_forget()


def client_of(buyer: Buyer) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_issue(buyer=buyer)}")
    return client


def put(client: APIClient, url: str, **more: Any) -> Any:
    return client.put(URL, {"url": url, **more}, format="json")


def no_private_networks(settings: Any) -> None:
    settings.WEBHOOKS = {**settings.WEBHOOKS, "ALLOWED_NETWORKS": []}


# -- set, read, clear through the API ----------------------------------------------------


def test_a_key_sets_reads_and_clears_its_callback_url(buyer):
    client = client_of(buyer)
    assert client.get(URL).json()["code"] == "callback_not_set"

    answer = put(client, "https://hooks.example.com/tollbooth", event_types=["purchase.paid"])
    assert answer.status_code == 200, answer.json()
    document = answer.json()
    assert document["url"] == "https://hooks.example.com/tollbooth"
    assert document["event_types"] == ["purchase.paid"]
    assert document["enabled"] is True
    assert document["key_id"].startswith("cb_")
    assert document["secret"].startswith("whsec_") and len(document["secret"]) > 40
    assert answer["Cache-Control"] == "no-store"
    # The database holds a salt, never the secret.
    row = WebhookEndpoint.objects.get(api_key__buyer=buyer)
    assert document["secret"] not in json.dumps(list(WebhookEndpoint.objects.values()), default=str)
    assert row.secret_env == ""

    read = client.get(URL)
    assert read.status_code == 200
    assert "secret" not in read.json()
    assert read.json()["key_id"] == document["key_id"]

    again = put(client, "https://hooks.example.com/v2").json()
    assert (again["key_id"], again["secret"]) != (document["key_id"], document["secret"])
    assert WebhookEndpoint.objects.filter(api_key__buyer=buyer).count() == 1

    assert client.delete(URL).status_code == 204
    assert client.get(URL).status_code == 404
    assert client.delete(URL).json()["code"] == "callback_not_set"
    assert not WebhookEndpoint.objects.exists()


def test_each_key_has_its_own_callback_and_another_buyer_never_sees_it(buyer):
    mine, second_key = client_of(buyer), client_of(buyer)
    put(mine, "https://hooks.example.com/one")
    assert second_key.get(URL).status_code == 404
    other = client_of(BuyerFactory.create())
    assert other.get(URL).status_code == 404
    assert APIClient().get(URL).status_code == 401


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://hooks.example.com/x", "url_malformed"),
        ("not a url", "url_malformed"),
        ("https://user:pw@hooks.example.com/x", "url_malformed"),
        ("https://" + "a" * 500 + ".example.com/", "url_malformed"),
        ("http://127.0.0.1:8000/x", "address_refused"),
        ("http://localhost:8000/x", "address_refused"),
        ("http://10.0.0.7/x", "address_refused"),
        ("http://192.168.1.1/x", "address_refused"),
        ("http://169.254.169.254/latest/meta-data", "address_refused"),
        ("http://[::1]:8000/x", "address_refused"),
        ("http://[::ffff:127.0.0.1]:8000/x", "address_refused"),
        ("http://[fe80::1]/x", "address_refused"),
        ("http://224.0.0.1/x", "address_refused"),
        ("http://0.0.0.0/x", "address_refused"),
    ],
)
def test_a_bad_callback_url_is_a_clear_400_and_changes_nothing(buyer, settings, url, reason):
    no_private_networks(settings)
    answer = put(client_of(buyer), url)
    assert answer.status_code == 400
    assert (answer.json()["code"], answer.json()["reason"]) == ("callback_url_invalid", reason)
    assert not WebhookEndpoint.objects.exists()


def test_production_takes_only_https(buyer, settings):
    settings.WEBHOOKS = {**settings.WEBHOOKS, "REQUIRE_HTTPS": True}
    answer = put(client_of(buyer), "http://hooks.example.com/x")
    assert (answer.status_code, answer.json()["reason"]) == (400, "https_required")
    assert put(client_of(buyer), "https://hooks.example.com/x").status_code == 200


def test_unknown_event_types_are_a_400(buyer):
    answer = put(client_of(buyer), "https://hooks.example.com/x", event_types=["purchase.nope"])
    assert (answer.status_code, answer.json()["code"]) == (400, "invalid_request")
    assert "event_types" in answer.json()["errors"]


# -- only the owner's purchases reach it ---------------------------------------------------


def test_a_callback_hears_of_its_buyers_purchases_only_signed_with_its_own_secret(
    buyer, receiver: Receiver
):
    document = put(client_of(buyer), receiver.url, event_types=["purchase.paid"]).json()
    stranger = BuyerFactory.create()
    fund(stranger, 10_000_000)
    admins = endpoint(receiver.url + "/admin", event_types=["purchase.paid"])

    mine = pay(buyer, key="callback-owner-key-0001")
    theirs = pay(stranger, key="callback-other-key-0001")
    for event in WebhookEvent.objects.filter(type="purchase.paid"):
        webhook_event_publish(event_id=event.pk)

    callback = WebhookEndpoint.objects.get(api_key__isnull=False)
    assert sorted(
        WebhookDelivery.objects.filter(endpoint=callback).values_list(
            "event__purchase__ref", flat=True
        )
    ) == [mine.ref]
    assert WebhookDelivery.objects.filter(endpoint=admins).count() == 2  # the admins' hear all
    to_callback = [r for r in receiver.received if r.path == "/hooks"]
    assert [json.loads(r.body)["purchase"] for r in to_callback] == [mine.ref]
    assert theirs.ref not in to_callback[0].body.decode()
    header = to_callback[0].headers["Tollbooth-Signature"]
    assert f"kid={document['key_id']}," in header
    verify = documented_verifier()
    assert verify(header, to_callback[0].body, {document["key_id"]: document["secret"].encode()})
    assert not verify(header, to_callback[0].body, {document["key_id"]: SECRET.encode()})


def test_a_revoked_keys_callback_hears_nothing_more(buyer, receiver: Receiver):
    put(client_of(buyer), receiver.url)
    key = WebhookEndpoint.objects.get().api_key
    assert key is not None
    key.revoked_at = timezone.now()
    key.save(update_fields=["revoked_at"])
    purchase = pay(buyer, key="callback-revoked-key-001")
    for event in WebhookEvent.objects.filter(purchase=purchase):
        webhook_event_publish(event_id=event.pk)
    assert not WebhookDelivery.objects.exists()
    assert receiver.received == []


# -- the guard at delivery time --------------------------------------------------------------


def _row(url: str) -> WebhookEndpoint:
    """An endpoint row written around the form and the API (a shell, an old row): the guard
    at send time is what stops it."""
    return WebhookEndpoint.objects.create(
        url=url, secret_env="TOLLBOOTH_TEST_WEBHOOK_SECRET", key_id="k2"
    )


def test_a_url_resolving_to_a_private_address_is_refused_when_sent(
    buyer, receiver: Receiver, settings
):
    no_private_networks(settings)
    port = receiver.url.split(":")[2].split("/")[0]
    urls = [
        receiver.url,  # 127.0.0.1, listening: nothing reaches it
        f"http://localhost:{port}/hooks",  # a name, resolved at send time
        f"http://[::1]:{port}/hooks",
        f"http://[::ffff:127.0.0.1]:{port}/hooks",
        "http://10.20.30.40/hooks",
        "http://169.254.169.254/latest/meta-data",
    ]
    rows = [_row(url) for url in urls]
    purchase = pay(buyer)
    event = WebhookEvent.objects.get(purchase=purchase, type="purchase.paid")
    webhook_event_publish(event_id=event.pk)

    assert receiver.received == []
    attempts = WebhookAttempt.objects.filter(delivery__endpoint__in=rows)
    assert sorted(attempts.values_list("delivery__endpoint__url", "error")) == sorted(
        (url, "address_refused") for url in urls
    )
    assert set(attempts.values_list("status_code", flat=True)) == {None}
    assert set(WebhookDelivery.objects.values_list("state", flat=True)) == {"pending"}

    # Allow-listed (tests, a local receiver), the same row is delivered.
    settings.WEBHOOKS = {**settings.WEBHOOKS, "ALLOWED_NETWORKS": ["127.0.0.0/8"]}
    delivery = WebhookDelivery.objects.get(endpoint=rows[0])
    at = delivery.next_attempt_at
    assert webhook_delivery_attempt(delivery_id=delivery.pk, now=at) == Outcome.DELIVERED
    assert len(receiver.received) == 1


def test_a_host_that_does_not_resolve_is_a_failed_try(buyer):
    row = _row("http://no-such-host.invalid/hooks")
    purchase = pay(buyer)
    webhook_event_publish(event_id=WebhookEvent.objects.get(purchase=purchase).pk)
    assert WebhookAttempt.objects.get(delivery__endpoint=row).error == "dns_error"


def test_a_redirect_is_not_followed(buyer, receiver: Receiver):
    with serving() as elsewhere:
        receiver.status, receiver.headers = 302, {"Location": elsewhere.url}
        endpoint(receiver.url)
        purchase = pay(buyer)
        webhook_event_publish(event_id=WebhookEvent.objects.get(purchase=purchase).pk)
        assert len(receiver.received) == 1
        assert elsewhere.received == []
    delivery = WebhookDelivery.objects.get()
    assert (delivery.state, delivery.last_status) == ("pending", 302)  # not a 2xx: retried


def test_the_answer_read_is_bounded(buyer, receiver: Receiver):
    receiver.answer = b"x" * 5_000_000
    endpoint(receiver.url)
    purchase = pay(buyer)
    webhook_event_publish(event_id=WebhookEvent.objects.get(purchase=purchase).pk)
    attempt = WebhookAttempt.objects.get()
    assert (attempt.status_code, len(attempt.response_excerpt)) == (200, 1_000)


# -- pruning -----------------------------------------------------------------------------------


def test_delivered_deliveries_past_retention_are_pruned_with_their_attempts(
    buyer, receiver: Receiver, settings
):
    settings.WEBHOOKS = {**settings.WEBHOOKS, "DELIVERED_RETENTION_DAYS": 30}
    hook = endpoint(receiver.url)
    now = timezone.now()
    purchases = [pay(buyer, key=f"prune-test-key-{n:04d}") for n in range(4)]
    events = [WebhookEvent.objects.get(purchase=p) for p in purchases]
    for event in events:
        webhook_event_publish(event_id=event.pk)
    old, recent, failed, pending = (WebhookDelivery.objects.get(event=e) for e in events)
    WebhookDelivery.objects.filter(pk=old.pk).update(delivered_at=now - timedelta(days=31))
    WebhookDelivery.objects.filter(pk=recent.pk).update(delivered_at=now - timedelta(days=29))
    WebhookDelivery.objects.filter(pk=failed.pk).update(
        state="failed", delivered_at=None, created_at=now - timedelta(days=90)
    )
    WebhookDelivery.objects.filter(pk=pending.pk).update(state="pending", delivered_at=None)

    assert webhook_deliveries_prune(now=now, batch=1) == 1
    assert set(WebhookDelivery.objects.values_list("pk", flat=True)) == {
        recent.pk,
        failed.pk,
        pending.pk,
    }
    assert not WebhookAttempt.objects.filter(delivery_id=old.pk).exists()
    assert WebhookEvent.objects.filter(pk=events[0].pk).exists()  # it keeps the sequence
    assert webhook_deliveries_prune(now=now) == 0
    assert hook.deliveries.count() == 3
