"""Boundary events on the purchase's timeline (issue 10, "a complete timeline"): replays,
in-flight answers and conflicts of a payment id, deliveries and redeliveries, requests past
retention, receipt fetches and alerts. Real PostgreSQL, through the real API and services."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from core.canonical import fingerprint
from fulfillment.models import Result
from purchases import event_subjects
from purchases.models import IdempotencyRecord, Purchase, PurchaseEvent
from purchases.services.checkout.idempotency import (
    KeyedRequest,
    payment_id_claim,
    payment_id_mark_recorded,
)
from purchases.services.fulfil.execution import purchase_execute
from purchases.services.jobs import housekeeping
from purchases.services.shared.alerts import escalation_alert, refund_alert
from tests.conftest import CSV_INPUT
from tests.factories import BuyerFactory, EscalationFactory, RefundFactory, fund
from tests.purchases.test_timeline_labels import written_subjects

pytestmark = [pytest.mark.django_db]
KEY = "timeline-key-000000000001"


def _quote(client: APIClient, offering, data=None) -> str:
    response = client.post(
        "/api/v1/quotes", {"offering": offering.slug, "input": data or CSV_INPUT}, format="json"
    )
    assert response.status_code in (200, 201), response.content
    return str(response.json()["id"])


def _pay(client: APIClient, quote_id: str, key: str = KEY):
    return client.post(
        f"/api/v1/quotes/{quote_id}/purchase",
        {"rail": "prepaid"},
        format="json",
        HTTP_IDEMPOTENCY_KEY=key,
    )


def _events(purchase: Purchase, subject: str) -> list[PurchaseEvent]:
    return list(purchase.events.filter(subject=subject).order_by("pk"))


def _paid(client: APIClient, offering) -> Purchase:
    response = _pay(client, _quote(client, offering))
    assert response.status_code == 201, response.content
    return Purchase.objects.get(ref=response.json()["purchase"])


def test_a_replay_is_on_the_purchase_the_key_names(client_for_buyer, buyer, offering):
    purchase = _paid(client_for_buyer, offering)
    assert not _events(purchase, event_subjects.PAYMENT_ID_REPLAYED)

    replay = _pay(client_for_buyer, purchase.quote.public_id)

    assert replay.status_code == 201 and replay["Idempotent-Replayed"] == "true"
    [event] = _events(purchase, event_subjects.PAYMENT_ID_REPLAYED)
    record = IdempotencyRecord.objects.get(key=KEY)
    assert (event.actor_type, event.actor) == ("agent", buyer.ref)
    assert event.evidence == {
        "scope": "prepaid",
        "record": record.pk,
        "principal_matches": True,
        "request_matches": True,
        "answered_at": event.evidence["answered_at"],
        "answer_status": 201,
    }
    assert event.evidence["answered_at"].startswith(record.completed_at.strftime("%Y-%m-%dT%H:%M"))
    assert KEY not in str(event.evidence)  # the client's id is never shown in clear


def test_a_changed_request_is_a_conflict_on_the_original_purchase_left_unchanged(
    client_for_buyer, buyer, offering
):
    purchase = _paid(client_for_buyer, offering)
    before = Purchase.objects.filter(pk=purchase.pk).values().get()
    other_quote = _quote(client_for_buyer, offering, {**CSV_INPUT, "title": "B"})

    conflict = _pay(client_for_buyer, other_quote)

    assert conflict.status_code == 409
    assert conflict.json()["purchase"] is None and purchase.ref not in conflict.content.decode()
    [event] = _events(purchase, event_subjects.PAYMENT_ID_CONFLICT)
    assert (event.actor, event.evidence["principal_matches"]) == (buyer.ref, True)
    assert event.evidence["request_matches"] is False
    assert Purchase.objects.filter(pk=purchase.pk).values().get() == before
    assert not _events(purchase, event_subjects.PAYMENT_ID_REPLAYED)


def test_another_buyers_reuse_of_the_key_is_a_conflict_on_the_original(
    client_for_buyer, offering, make_client
):
    purchase = _paid(client_for_buyer, offering)
    other = BuyerFactory.create()
    fund(other, 10_000_000)
    other_client = make_client(other)

    conflict = _pay(other_client, _quote(other_client, offering))

    assert conflict.status_code == 409 and conflict.json()["purchase"] is None
    [event] = _events(purchase, event_subjects.PAYMENT_ID_CONFLICT)
    assert (event.actor, event.evidence["principal_matches"]) == (other.ref, False)
    assert not Purchase.objects.filter(buyer=other).exists()


def test_an_in_flight_answer_is_on_the_purchase_the_key_names(client_for_buyer, buyer, offering):
    purchase = _paid(client_for_buyer, offering)
    quote_id = purchase.quote.public_id
    key = "timeline-key-in-flight-01"
    # Another request holds this key and has recorded its payment (recovery point), not yet
    # answered: the key names the purchase already.
    claim = payment_id_claim(
        request=KeyedRequest(
            scope="prepaid",
            key=key,
            principal=buyer.ref,
            fingerprint=fingerprint({"quote": quote_id, "rail": "prepaid"}),
            now=timezone.now(),
        )
    )
    payment_id_mark_recorded(claim=claim, purchase=purchase)

    answer = _pay(client_for_buyer, quote_id, key=key)

    assert answer.status_code == 409 and answer.json()["code"] == "payment_in_flight"
    [event] = _events(purchase, event_subjects.PAYMENT_ID_IN_FLIGHT)
    assert (event.reason_code, event.actor) == ("payment_in_flight", buyer.ref)
    assert event.evidence["recovery_point"] == "payment_recorded"
    assert event.evidence["lease_until"] is not None


def test_a_payment_id_past_retention_is_on_the_purchase(client_for_buyer, offering):
    purchase = _paid(client_for_buyer, offering)
    purchase_execute(purchase_id=purchase.pk, worker="test")
    compacted = housekeeping.compact_payment_ids(now=timezone.now() + timedelta(hours=25))
    assert compacted["compacted"] == 1

    answer = _pay(client_for_buyer, purchase.quote.public_id)

    assert answer.status_code == 410 and answer.json()["code"] == "retention_expired"
    [event] = _events(purchase, event_subjects.PAYMENT_ID_RETENTION_EXPIRED)
    assert event.evidence["principal_matches"] is True
    assert not _events(purchase, event_subjects.PAYMENT_ID_REPLAYED)


# PostgreSQL only: the first delivery's stamp and its event are one statement there (the
# same instant, asserted below); the SQLite twin writes them a moment apart.
@pytest.mark.postgres
def test_first_delivery_redeliveries_and_receipt_fetches_are_on_the_timeline(
    client_for_buyer, buyer, offering
):
    purchase = _paid(client_for_buyer, offering)
    purchase_execute(purchase_id=purchase.pk, worker="test")
    url = f"/api/v1/purchases/{purchase.ref}/result"

    first, again = client_for_buyer.get(url), client_for_buyer.get(url)
    receipt_url = first["Link"].split(">")[0].lstrip("<")
    assert APIClient().get(receipt_url).status_code == 200

    assert first.status_code == again.status_code == 200
    result = Result.objects.get(purchase=purchase)
    [delivered] = _events(purchase, event_subjects.RESULT_DELIVERED)
    [redelivered] = _events(purchase, event_subjects.RESULT_REDELIVERED)
    assert result.first_delivered_at is not None
    for event in (delivered, redelivered):
        assert (event.actor, event.evidence["channel"]) == (buyer.ref, "api")
        assert event.evidence["sha256"] == result.sha256
        assert event.evidence["first_delivered_at"] == result.first_delivered_at.isoformat()
    assert delivered.created_at == result.first_delivered_at
    [fetched] = _events(purchase, event_subjects.RECEIPT_FETCHED)
    assert fetched.evidence["receipt"] == purchase.receipt.public_id


def test_a_result_asked_for_after_its_retention_is_on_the_timeline(client_for_buyer, offering):
    purchase = _paid(client_for_buyer, offering)
    purchase_execute(purchase_id=purchase.pk, worker="test")
    Result.objects.filter(purchase=purchase).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )

    answer = client_for_buyer.get(f"/api/v1/purchases/{purchase.ref}/result")

    assert answer.status_code == 410
    [event] = _events(purchase, event_subjects.RESULT_RETENTION_EXPIRED)
    assert (event.reason_code, event.evidence["channel"]) == ("result_expired", "api")
    assert not _events(purchase, event_subjects.RESULT_DELIVERED)
    assert Result.objects.get(purchase=purchase).first_delivered_at is None


def test_an_alert_sent_names_its_channels_and_recipients(settings, mailoutbox):
    settings.TOLLBOOTH_ALERT_BACKENDS = ["mail"]
    settings.ADMINS = [("Finance", "finance@example.test")]
    refund = RefundFactory.create()

    assert refund_alert(refund_id=refund.pk) is True

    [event] = _events(refund.purchase, event_subjects.ALERT_SENT)
    assert (event.actor, event.reason_code) == ("alerts", "refund_owed")
    assert event.evidence == {
        "kind": "refund_owed",
        "alert_key": f"tollbooth-refund-{refund.pk}",
        "delivered_via": ["mail"],
        "failed": {},
        "recipients": {"mail": "finance@example.test"},
    }
    assert len(mailoutbox) == 1


def test_an_alert_that_reached_nobody_is_on_the_timeline_and_retried(settings):
    settings.TOLLBOOTH_ALERT_BACKENDS = ["webhook"]
    settings.TOLLBOOTH_ALERT_WEBHOOK_URL = "http://127.0.0.1:9/hook?token=secret"
    escalation = EscalationFactory.create()

    assert escalation_alert(escalation_id=escalation.pk) is False

    [event] = _events(escalation.purchase, event_subjects.ALERT_FAILED)
    assert event.evidence["delivered_via"] == []
    assert event.evidence["recipients"] == {"webhook": "127.0.0.1:9"}  # never the token
    assert event.evidence["failed"]["webhook"].startswith("AlertNotDelivered: webhook:")
    assert "no backend reached a person" in event.evidence["error"]
    escalation.refresh_from_db()
    assert escalation.alerted_at is None and escalation.alert_claimed_at is None


# --- the subject list the admin's labels are made from ------------------------------------


def test_every_subject_the_code_writes_is_listed_with_a_description():
    constants = {
        value
        for name, value in vars(event_subjects).items()
        if name.isupper() and isinstance(value, str)
    }
    assert constants == set(event_subjects.SUBJECTS)
    assert all(event_subjects.SUBJECTS.values())
    written = written_subjects()
    assert {"payment_attempt.broadcast", "payment_id.conflict", "receipt.fetched"} <= written
    assert written <= set(event_subjects.SUBJECTS), written - set(event_subjects.SUBJECTS)
