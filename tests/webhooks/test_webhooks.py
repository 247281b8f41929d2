"""Signed webhooks (docs/webhooks.md; issue 33, part 1): events written with the change,
delivered at least once from the worker to a real local endpoint, signed as documented."""

from __future__ import annotations

import itertools
import json
import random
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from rest_framework.test import APIClient

from core.actors import Actor
from doors.rest.prepaid_answers import PrepaidAnswers
from payments.services import payment_attempt_settled
from purchases.events import event_record, events_batched, events_of_one_row
from purchases.models import OutboxMessage, Purchase
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from purchases.services.quote.quotes import quote_create
from purchases.services.remedy.remedies import (
    escalation_open,
    escalation_resolve,
    purchase_refund_create,
)
from tests.conftest import CSV_INPUT
from tests.factories import OfferingFactory
from tests.webhooks.receiver import Receiver, dead_url
from tests.x402.e2e import ask, sign_payment
from webhooks import events as webhook_events
from webhooks.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookEvent
from webhooks.services import (
    RESPONSE_EXCERPT,
    RETRY_WINDOW,
    Outcome,
    webhook_deliveries_send_due,
    webhook_delivery_attempt,
    webhook_delivery_replay,
    webhook_endpoint_set_enabled,
    webhook_event_publish,
    webhook_test_send,
)

pytestmark = pytest.mark.django_db
DOCS = Path(__file__).resolve().parents[2] / "docs" / "webhooks.md"
SECRET = "whsec-test-current-0123456789"
OLD_SECRET = "whsec-test-previous-9876543210"


def documented_verifier() -> Any:
    """The verifier exactly as docs/webhooks.md prints it."""
    block = re.search(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    assert block is not None
    namespace: dict[str, Any] = {}
    exec(compile(block.group(1), str(DOCS), "exec"), namespace)  # noqa: S102 (our own docs)
    return namespace["tollbooth_verify"]


@pytest.fixture(autouse=True)
def _secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLBOOTH_TEST_WEBHOOK_SECRET", SECRET)
    monkeypatch.setenv("TOLLBOOTH_TEST_WEBHOOK_OLD_SECRET", OLD_SECRET)
    webhook_events.subscriptions_forget()


def endpoint(url: str, **fields: Any) -> WebhookEndpoint:
    fields = {"secret_env": "TOLLBOOTH_TEST_WEBHOOK_SECRET", "key_id": "k2", **fields}
    made = WebhookEndpoint(url=url, **fields)
    made.full_clean()
    made.save()
    return made


def pay(buyer: Any, key: str = "webhook-test-key-0001") -> Purchase:
    offering = OfferingFactory.create()
    quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=CSV_INPUT).quote
    answer, _ = purchase_pay_prepaid(
        answers=PrepaidAnswers(), buyer=buyer, quote_id=quote.public_id, payment_id=key
    )
    assert answer.status == 201, answer.body
    return Purchase.objects.get(ref=answer.purchase_ref)


def published(purchase: Purchase) -> WebhookEvent:
    event = WebhookEvent.objects.get(purchase=purchase, type="purchase.paid")
    webhook_event_publish(event_id=event.pk)
    return event


# -- events written with the change, and nothing more on the purchase's path ----------------


def test_a_paid_purchase_writes_its_event_with_the_change_and_never_calls_the_endpoint(
    buyer, receiver: Receiver
):
    receiver.delay_seconds = 3.0  # a slow endpoint: the purchase must not wait for it
    endpoint(receiver.url)
    started = time.monotonic()
    purchase = pay(buyer)
    elapsed = time.monotonic() - started

    event = WebhookEvent.objects.get(purchase=purchase)
    assert (event.type, event.sequence, event.body) == ("purchase.paid", 1, None)
    assert event.public_id.startswith("evt_")
    staged = OutboxMessage.objects.get(job="webhook_event_publish")
    assert staged.kwargs == {"event_id": event.pk}
    assert staged.relayed_at is None  # not sent on the purchase's path: the relay loop sends it
    assert receiver.received == []
    assert WebhookDelivery.objects.count() == 0
    assert elapsed < 3.0


def test_an_event_rolled_back_with_its_change_is_not_written(buyer, receiver: Receiver):
    endpoint(receiver.url)
    with pytest.raises(RuntimeError), transaction.atomic():
        pay(buyer)
        raise RuntimeError("the change's transaction fails after the move")
    assert WebhookEvent.objects.count() == 0
    assert not OutboxMessage.objects.filter(job="webhook_event_publish").exists()


def test_nothing_is_written_while_no_endpoint_subscribes_to_the_type(buyer, receiver: Receiver):
    endpoint(receiver.url, event_types=["refund.owed"])
    pay(buyer, key="webhook-test-key-0002")
    WebhookEndpoint.objects.update(enabled=False)
    webhook_events.subscriptions_forget()
    pay(buyer, key="webhook-test-key-0003")
    assert WebhookEvent.objects.count() == 0
    assert not OutboxMessage.objects.filter(job="webhook_event_publish").exists()


def test_an_endpoint_saved_by_another_process_is_read_after_the_ttl(
    buyer, receiver: Receiver, monkeypatch
):
    webhook_events.subscriptions_set(frozenset())
    # bulk_create sends no post_save: as if another process had saved it.
    WebhookEndpoint.objects.bulk_create(
        [WebhookEndpoint(url=receiver.url, secret_env="TOLLBOOTH_TEST_WEBHOOK_SECRET", key_id="k")]
    )
    pay(buyer, key="webhook-test-key-0004")
    assert WebhookEvent.objects.count() == 0  # this process has not read it yet
    monkeypatch.setattr(webhook_events, "SUBSCRIPTIONS_TTL", 0.0)
    pay(buyer, key="webhook-test-key-0005")
    assert list(WebhookEvent.objects.values_list("type", flat=True)) == ["purchase.paid"]


def test_a_purchases_events_carry_its_sequence(buyer, receiver: Receiver):
    endpoint(receiver.url)
    purchase = pay(buyer)
    now = timezone.now()
    with transaction.atomic():
        locked = Purchase.objects.select_for_update().get(pk=purchase.pk)
        escalation = escalation_open(
            purchase=locked,
            owner="support",
            reason_code="execution_outcome_unknown",
            now=now,
            actor=Actor.system(),
        )
    escalation_resolve(escalation=escalation, by="sam", resolution="refunded", now=now)
    with transaction.atomic():
        locked = Purchase.objects.select_for_update().get(pk=purchase.pk)
        attempt = payment_attempt_settled(purchase_id=purchase.pk)
        assert attempt is not None
        purchase_refund_create(
            purchase=locked,
            attempt=attempt,
            reason_code="execution_failed",
            now=now,
            actor=Actor.staff("sam"),
        )
    rows = list(
        WebhookEvent.objects.filter(purchase=purchase)
        .order_by("sequence")
        .values_list("type", "sequence", "reason_code")
    )
    assert rows == [
        ("purchase.paid", 1, ""),
        ("purchase.escalated", 2, "execution_outcome_unknown"),
        ("purchase.resolved", 3, "execution_outcome_unknown"),
        # Prepaid: owed, then credited back to the balance at once.
        ("refund.owed", 4, "execution_failed"),
        ("refund.paid", 5, ""),
    ]
    assert OutboxMessage.objects.filter(job="webhook_event_publish").count() == 5


def test_a_timeline_event_that_is_no_webhook_event_writes_nothing(buyer, receiver: Receiver):
    endpoint(receiver.url)
    purchase = pay(buyer)
    with transaction.atomic():
        event_record(
            subject="purchase.fulfillment",
            purchase=purchase,
            actor=Actor.system(),
            from_state="queued",
            to_state="running",
        )
    assert list(WebhookEvent.objects.values_list("type", flat=True)) == ["purchase.paid"]


def test_an_event_dropped_with_its_row_from_a_batch_is_never_published(buyer, receiver: Receiver):
    endpoint(receiver.url)
    purchase = pay(buyer)
    # A bulk recorder (the settlement batch) leaves a row that raised to the one-row path,
    # which records its events again: the dropped ones must not have become webhooks.
    with transaction.atomic(), events_batched():
        with pytest.raises(RuntimeError), events_of_one_row():
            event_record(
                subject="purchase.fulfillment",
                purchase=purchase,
                actor=Actor.system(),
                from_state="running",
                to_state="failed",
            )
            raise RuntimeError("this row is left to the one-row path")
        event_record(
            subject="purchase.fulfillment",
            purchase=purchase,
            actor=Actor.system(),
            from_state="running",
            to_state="succeeded",
        )
    assert list(WebhookEvent.objects.order_by("sequence").values_list("type", "sequence")) == [
        ("purchase.paid", 1),
        ("purchase.succeeded", 2),
    ]


@pytest.mark.parametrize(
    ("subject", "to_state", "event_type"),
    [
        ("payment_attempt.reorged", "settlement_pending", "settlement.reorged"),
        ("payout.broadcast", "broadcast", "payout.sent"),
        ("payout", "failed", "payout.failed"),
        ("refund", "proposed", "refund.proposed"),
        ("refund", "declined", "refund.declined"),
        ("purchase.payment", "failed", "purchase.failed"),
        ("purchase.fulfillment", "unknown", "purchase.outcome_unknown"),
    ],
)
def test_each_boundary_event_becomes_its_webhook_type(
    buyer, receiver: Receiver, subject: str, to_state: str, event_type: str
):
    endpoint(receiver.url)
    purchase = pay(buyer)
    with transaction.atomic():
        event_record(subject=subject, purchase=purchase, actor=Actor.system(), to_state=to_state)
    assert list(WebhookEvent.objects.order_by("sequence").values_list("type", "sequence")) == [
        ("purchase.paid", 1),
        (event_type, 2),
    ]


# -- delivery, signature ----------------------------------------------------------------


def test_a_2xx_delivers_the_purchase_document_signed_as_documented(buyer, receiver: Receiver):
    hook = endpoint(receiver.url)
    purchase = pay(buyer)
    event = published(purchase)

    delivery = WebhookDelivery.objects.get(event=event, endpoint=hook)
    assert (delivery.state, delivery.attempts, delivery.last_status) == ("delivered", 1, 200)
    [got] = receiver.received
    body = json.loads(got.body)
    assert (body["id"], body["type"], body["sequence"]) == (event.public_id, "purchase.paid", 1)
    assert body["purchase"] == purchase.ref
    assert body["data"]["payment"]["state"] == "paid"
    assert got.headers["Tollbooth-Event-Id"] == event.public_id
    verify = documented_verifier()
    header = got.headers["Tollbooth-Signature"]
    assert verify(header, got.body, {"k2": SECRET.encode()})
    assert not verify(header, got.body + b" ", {"k2": SECRET.encode()})
    assert not verify(header, got.body, {"k2": b"another secret"})
    assert not verify(header, got.body, {"k1": SECRET.encode()})  # the key id matters
    assert not verify(header, got.body, {"k2": SECRET.encode()}, now=time.time() + 3600)
    attempt = WebhookAttempt.objects.get(delivery=delivery)
    assert (attempt.status_code, attempt.response_excerpt, attempt.error) == (200, "ok", "")


def test_during_a_rotation_either_secret_verifies(buyer, receiver: Receiver):
    endpoint(
        receiver.url, previous_secret_env="TOLLBOOTH_TEST_WEBHOOK_OLD_SECRET", previous_key_id="k1"
    )
    published(pay(buyer))
    [got] = receiver.received
    header = got.headers["Tollbooth-Signature"]
    verify = documented_verifier()
    assert verify(header, got.body, {"k1": OLD_SECRET.encode()})
    assert verify(header, got.body, {"k2": SECRET.encode()})
    assert not verify(header, got.body, {"k1": SECRET.encode()})


def test_a_missing_secret_sends_nothing_unsigned(buyer, receiver: Receiver, monkeypatch):
    endpoint(receiver.url)
    purchase = pay(buyer)
    monkeypatch.delenv("TOLLBOOTH_TEST_WEBHOOK_SECRET")
    event = published(purchase)
    assert receiver.received == []
    delivery = WebhookDelivery.objects.get(event=event)
    assert delivery.state == "pending"
    assert WebhookAttempt.objects.get(delivery=delivery).error == "secret_missing"


def test_an_error_answer_is_kept_bounded_and_retried_until_a_2xx(buyer, receiver: Receiver):
    endpoint(receiver.url)
    receiver.status, receiver.answer = 500, b"x" * 10_000
    now = timezone.now()
    event = WebhookEvent.objects.get(purchase=pay(buyer))
    webhook_event_publish(event_id=event.pk, now=now)
    delivery = WebhookDelivery.objects.get(event=event)
    assert (delivery.state, delivery.last_status) == ("pending", 500)
    assert now + timedelta(seconds=15) <= delivery.next_attempt_at <= now + timedelta(seconds=30)
    first = WebhookAttempt.objects.get(delivery=delivery)
    assert first.response_excerpt == "x" * RESPONSE_EXCERPT
    # Not due yet: the sweep leaves it.
    assert webhook_deliveries_send_due(now=now + timedelta(seconds=1)) == 0
    receiver.status, receiver.answer = 204, b""
    assert webhook_deliveries_send_due(now=delivery.next_attempt_at) == 1
    delivery.refresh_from_db()
    assert (delivery.state, delivery.attempts, delivery.last_status) == ("delivered", 2, 204)
    assert len(receiver.received) == 2
    assert {r.headers["Tollbooth-Event-Id"] for r in receiver.received} == {event.public_id}


def test_an_event_whose_publication_was_lost_is_published_by_the_sweep(buyer, receiver: Receiver):
    endpoint(receiver.url)
    event = WebhookEvent.objects.get(purchase=pay(buyer))
    # Its outbox job was relayed and lost (a broker restart): nothing ran it.
    assert webhook_deliveries_send_due(now=event.occurred_at + timedelta(minutes=4)) == 0
    assert WebhookDelivery.objects.count() == 0
    assert webhook_deliveries_send_due(now=event.occurred_at + timedelta(minutes=5)) == 1
    delivery = WebhookDelivery.objects.get(event=event)
    assert delivery.state == "delivered"
    assert json.loads(receiver.received[0].body)["id"] == event.public_id


def test_a_dead_endpoint_is_retried_with_backoff_and_jitter_for_three_days(buyer):
    endpoint(dead_url())
    start = timezone.now()
    event = WebhookEvent.objects.get(purchase=pay(buyer))
    rng = random.Random(33)
    webhook_event_publish(event_id=event.pk, now=start)
    delivery = WebhookDelivery.objects.get(event=event)
    tries = [start]
    clock = start
    while True:
        delivery.refresh_from_db()
        if delivery.state != "pending":
            break
        assert delivery.next_attempt_at > clock
        clock = delivery.next_attempt_at  # the test's clock jumps to the next try: no sleeping
        assert webhook_delivery_attempt(delivery_id=delivery.pk, now=clock, rng=rng) in (
            Outcome.RETRY,
            Outcome.FAILED,
        )
        tries.append(clock)
    assert (delivery.state, delivery.failure_reason) == ("failed", "retries_exhausted")
    assert tries[-1] == start + RETRY_WINDOW  # the last try at the window's end, not after
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(tries)]
    assert 15 <= gaps[0] <= 30 and 30 <= gaps[1] <= 60 and 60 <= gaps[2] <= 120
    assert max(gaps) <= 6 * 3600
    assert len(set(gaps[:8])) == 8  # jittered
    assert 15 <= len(tries) <= 30
    assert WebhookAttempt.objects.filter(delivery=delivery).count() == len(tries)
    assert set(WebhookAttempt.objects.values_list("error", flat=True)) == {"connection_error"}


def test_a_410_disables_the_endpoint_and_its_deliveries_wait(buyer, receiver: Receiver):
    hook = endpoint(receiver.url)
    receiver.status = 410
    event = published(pay(buyer))
    hook.refresh_from_db()
    assert (hook.enabled, hook.disabled_reason) == (False, "endpoint_gone")
    assert WebhookDelivery.objects.get(event=event).failure_reason == "endpoint_gone"
    # Disabled: later events are not even written; an older pending delivery waits.
    assert webhook_deliveries_send_due(now=timezone.now() + timedelta(days=1)) == 0
    receiver.status = 200
    webhook_endpoint_set_enabled(endpoint_id=hook.pk, enabled=True)
    assert WebhookEndpoint.objects.get(pk=hook.pk).enabled


def test_a_slow_endpoint_costs_the_worker_its_timeout_only(buyer, receiver: Receiver):
    endpoint(receiver.url)
    receiver.delay_seconds = 3.0
    event = WebhookEvent.objects.get(purchase=pay(buyer))
    started = time.monotonic()
    webhook_event_publish(event_id=event.pk)
    assert time.monotonic() - started < 2.5  # test settings: 1 s read timeout
    attempt = WebhookAttempt.objects.get()
    assert (attempt.status_code, attempt.error) == (None, "timeout")
    assert 900 <= attempt.latency_ms < 2500
    assert WebhookDelivery.objects.get(event=event).state == "pending"


def test_replay_sends_a_delivered_event_again_through_the_outbox(buyer, receiver: Receiver):
    endpoint(receiver.url)
    event = published(pay(buyer))
    delivery = WebhookDelivery.objects.get(event=event)
    with pytest.raises(Exception):  # noqa: B017 (django-fsm protects the state)
        delivery.state = "pending"
    webhook_delivery_replay(delivery_id=delivery.pk)
    staged = OutboxMessage.objects.get(job="webhook_delivery_attempt")
    assert staged.kwargs == {"delivery_id": delivery.pk}
    assert webhook_delivery_attempt(delivery_id=delivery.pk) == Outcome.DELIVERED
    assert len(receiver.received) == 2
    assert receiver.received[0].body == receiver.received[1].body  # the same event, same bytes


def test_a_test_event_goes_to_its_endpoint_only(receiver: Receiver):
    hook = endpoint(receiver.url)
    other = endpoint(dead_url())
    event = webhook_test_send(endpoint_id=hook.pk)
    webhook_event_publish(event_id=event.pk)
    assert list(WebhookDelivery.objects.values_list("endpoint", "state")) == [
        (hook.pk, "delivered")
    ]
    assert other.pk
    assert json.loads(receiver.received[0].body)["type"] == "webhook.test"


def test_https_is_required_unless_the_settings_allow_http(settings):
    settings.WEBHOOKS = {**settings.WEBHOOKS, "REQUIRE_HTTPS": True}
    with pytest.raises(ValidationError) as refused:
        endpoint("http://example.test/hooks")
    assert "url" in refused.value.message_dict
    assert endpoint("https://example.test/hooks").pk
    with pytest.raises(ValidationError):
        endpoint("https://example.test/hooks", secret_env="not a name", event_types=["nope"])


def test_an_http_endpoint_is_never_sent_to_where_https_is_required(
    buyer, receiver: Receiver, settings
):
    endpoint(receiver.url)  # written while http was allowed
    event = WebhookEvent.objects.get(purchase=pay(buyer))
    settings.WEBHOOKS = {**settings.WEBHOOKS, "REQUIRE_HTTPS": True}
    webhook_event_publish(event_id=event.pk)
    assert receiver.received == []
    assert WebhookAttempt.objects.get().error == "https_required"
    assert WebhookDelivery.objects.get().state == "pending"


def test_production_settings_require_https():
    source = (Path(__file__).resolve().parents[2] / "config/settings/production.py").read_text()
    assert '"REQUIRE_HTTPS": True' in source


@pytest.mark.postgres
def test_an_x402_purchase_settled_on_chain_writes_its_paid_event(x402_world, receiver: Receiver):
    endpoint(receiver.url)
    client = APIClient()
    payment = sign_payment(ask(client, x402_world)["PAYMENT-REQUIRED"], x402_world.payers[0], None)
    with transaction.atomic():  # the request's commit hooks run inside the test's transaction
        paid = ask(client, x402_world, payment=payment)
    assert paid.status_code in (200, 202), paid.content
    purchase = Purchase.objects.get()
    assert purchase.payment_state == "paid"
    assert list(WebhookEvent.objects.values_list("purchase", "type", "sequence")) == [
        (purchase.pk, "purchase.paid", 1)
    ]
    assert receiver.received == []
