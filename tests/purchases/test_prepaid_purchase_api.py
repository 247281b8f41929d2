from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from django.utils import timezone

from fulfillment.models import Receipt
from payments.models import LedgerEntry, PaymentAttempt
from payments.services import ledger_balance
from purchases.models import IdempotencyRecord, Purchase, Quote
from purchases.services.checkout.idempotency import (
    KeyedRequest,
    payment_id_claim,
    payment_id_conflicts,
)
from purchases.services.fulfil.execution import ExecutionOutcome, purchase_execute
from tests.conftest import CSV_INPUT
from tests.factories import USDC_LOCAL, BuyerFactory, fund

# Also run on the embedded SQLite default (`make test`'s second pass): `make demo` serves this.
pytestmark = [pytest.mark.django_db, pytest.mark.embedded]
KEY = "pay-0001-aaaaaaaaaaaa"


def new_quote(client, offering, data=None) -> str:
    response = client.post(
        "/api/v1/quotes", {"offering": offering.slug, "input": data or CSV_INPUT}, format="json"
    )
    assert response.status_code in (200, 201), response.content
    return response.json()["id"]


def pay(client, quote_id, key=KEY, rail="prepaid"):
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key is not None else {}
    return client.post(
        f"/api/v1/quotes/{quote_id}/purchase", {"rail": rail}, format="json", **headers
    )


def debits(buyer) -> int:
    return LedgerEntry.objects.filter(buyer=buyer, kind=LedgerEntry.Kind.PURCHASE_DEBIT).count()


def test_prepaid_purchase_debits_once_and_marks_paid(client_for_buyer, buyer, offering):
    quote_id = new_quote(client_for_buyer, offering)
    response = pay(client_for_buyer, quote_id)
    assert response.status_code == 201
    body = response.json()
    assert body["payment"]["state"] == "paid"
    assert body["execution"]["state"] == "queued"
    assert body["next_action"] == "poll_result"
    assert response["Location"] == f"/api/v1/purchases/{body['purchase']}"
    assert ledger_balance(buyer_id=buyer.pk, asset=USDC_LOCAL) == 10_000_000 - 250_000
    purchase = Purchase.objects.get(ref=body["purchase"])
    assert purchase.quote.state == Quote.State.ACCEPTED
    assert PaymentAttempt.objects.get(purchase=purchase).state == PaymentAttempt.State.SUCCEEDED
    subjects = list(purchase.events.values_list("subject", "to_state"))
    assert ("purchase.payment", "paid") in subjects
    assert ("purchase.fulfillment", "queued") in subjects


def test_same_key_same_request_replays_the_stored_answer(client_for_buyer, buyer, offering):
    quote_id = new_quote(client_for_buyer, offering)
    first = pay(client_for_buyer, quote_id)
    second = pay(client_for_buyer, quote_id)
    assert second.status_code == 201
    assert second.content == first.content  # byte for byte, not just equal JSON
    assert second["Idempotent-Replayed"] == "true"
    assert debits(buyer) == 1


def test_stored_error_is_replayed_even_after_the_cause_is_fixed(client_for_buyer, offering):
    poor = BuyerFactory.create()
    fund(poor, 100)
    from purchases.services.shared.buyers import api_key_issue

    client_for_buyer.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_issue(buyer=poor)}")
    quote_id = new_quote(client_for_buyer, offering)
    first = pay(client_for_buyer, quote_id)
    assert first.status_code == 402
    assert first.json()["code"] == "insufficient_funds"
    assert first.json()["owner"] == "buyer"
    # The refused purchase was rolled back: the answer names no reference that does not exist.
    assert first.json()["purchase"] is None and not Purchase.objects.exists()
    fund(poor, 10_000_000)
    replay = pay(client_for_buyer, quote_id)
    assert replay.status_code == 402
    assert replay.content == first.content
    assert replay["Content-Type"] == "application/problem+json"
    assert debits(poor) == 0
    fresh = pay(client_for_buyer, quote_id, key="pay-0002-bbbbbbbbbbbb")
    assert fresh.status_code == 201


def test_same_key_changed_request_is_a_conflict(client_for_buyer, buyer, offering, caplog):
    quote_a = new_quote(client_for_buyer, offering)
    quote_b = new_quote(client_for_buyer, offering, {**CSV_INPUT, "title": "B"})
    assert pay(client_for_buyer, quote_a).status_code == 201
    conflicts_before = payment_id_conflicts.labels(scope="prepaid")._value.get()
    conflict = pay(client_for_buyer, quote_b)
    assert conflict.status_code == 409
    assert conflict.json()["code"] == "payment_identifier_conflict"
    assert conflict.json()["purchase"] is None
    # Conflicts are logged and counted for alerting; plain replays are not.
    assert payment_id_conflicts.labels(scope="prepaid")._value.get() == conflicts_before + 1
    assert "payment id conflict" in caplog.text
    pay(client_for_buyer, quote_a)
    assert payment_id_conflicts.labels(scope="prepaid")._value.get() == conflicts_before + 1
    assert debits(buyer) == 1
    assert not Purchase.objects.filter(quote__public_id=quote_b).exists()


def test_same_key_other_buyer_is_a_conflict(client_for_buyer, buyer, offering, make_client):
    quote_id = new_quote(client_for_buyer, offering)
    assert pay(client_for_buyer, quote_id).status_code == 201
    other = BuyerFactory.create()
    fund(other, 10_000_000)
    other_client = make_client(other)
    other_quote = new_quote(other_client, offering)
    conflict = pay(other_client, other_quote)
    assert conflict.status_code == 409
    assert conflict.json()["code"] == "payment_identifier_conflict"
    assert debits(other) == 0


def test_same_key_still_running_is_in_flight_with_retry_after(client_for_buyer, buyer, offering):
    quote_id = new_quote(client_for_buyer, offering)
    from core.canonical import fingerprint

    # A first request holding the key right now (claimed, work not yet committed).
    payment_id_claim(
        request=KeyedRequest(
            scope="prepaid",
            key=KEY,
            principal=buyer.ref,
            fingerprint=fingerprint({"quote": quote_id, "rail": "prepaid"}),
            now=timezone.now(),
        )
    )
    response = pay(client_for_buyer, quote_id)
    assert response.status_code == 409
    assert response.json()["code"] == "payment_in_flight"
    assert response.json()["retryable"] is True
    assert int(response["Retry-After"]) >= 1
    assert debits(buyer) == 0
    # The holder died: once its lease runs out the retry resumes and completes.
    IdempotencyRecord.objects.filter(key=KEY).update(
        locked_until=timezone.now() - timedelta(seconds=1)
    )
    resumed = pay(client_for_buyer, quote_id)
    assert resumed.status_code == 201
    assert debits(buyer) == 1


def test_quote_already_paid_under_another_key_names_the_purchase(client_for_buyer, buyer, offering):
    offering.duplicate_window = timedelta(0)  # window off: the plain quote rule answers
    offering.save()
    quote_id = new_quote(client_for_buyer, offering)
    first = pay(client_for_buyer, quote_id).json()
    second = pay(client_for_buyer, quote_id, key="pay-0003-cccccccccccc")
    assert second.status_code == 402
    assert second.json()["code"] == "quote_already_paid"
    assert second.json()["purchase"] == first["purchase"]
    assert second.json()["next_action"] == "poll_existing_purchase"
    assert debits(buyer) == 1


def test_expired_quote(client_for_buyer, buyer, offering):
    quote_id = new_quote(client_for_buyer, offering)
    Quote.objects.filter(public_id=quote_id).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    response = pay(client_for_buyer, quote_id)
    assert response.status_code == 410
    assert response.json()["code"] == "quote_expired"
    assert response.json()["next_action"] == "request_quote"
    assert debits(buyer) == 0 and Purchase.objects.count() == 0


def test_spend_cap(client_for_buyer, buyer, offering):
    buyer.spend_cap = 300_000
    buyer.save()
    assert pay(client_for_buyer, new_quote(client_for_buyer, offering)).status_code == 201
    response = pay(
        client_for_buyer,
        new_quote(client_for_buyer, offering, {**CSV_INPUT, "title": "2"}),
        key="pay-0004-dddddddddddd",
    )
    assert response.status_code == 402
    assert response.json()["code"] == "spend_cap_exceeded"
    assert debits(buyer) == 1


@pytest.mark.parametrize(
    ("key", "code"),
    [
        (None, "idempotency_key_missing"),
        ("short", "idempotency_key_invalid"),
        ("has spaces in it 12345", "idempotency_key_invalid"),
    ],
)
def test_bad_or_missing_key_is_400(client_for_buyer, offering, key, code):
    response = pay(client_for_buyer, new_quote(client_for_buyer, offering), key=key)
    assert response.status_code == 400
    assert response.json()["code"] == code
    assert IdempotencyRecord.objects.count() == 0


def test_other_rails_are_refused_here(client_for_buyer, offering):
    response = pay(client_for_buyer, new_quote(client_for_buyer, offering), rail="x402")
    assert response.status_code == 400
    assert response.json()["code"] == "unsupported_rail"


def test_another_buyers_purchase_and_quote_answer_404(client_for_buyer, offering, make_client):
    quote_id = new_quote(client_for_buyer, offering)
    ref = pay(client_for_buyer, quote_id).json()["purchase"]
    stranger = make_client(BuyerFactory.create())
    for path in (f"/api/v1/purchases/{ref}", f"/api/v1/purchases/{ref}/result"):
        response = stranger.get(path)
        assert response.status_code == 404
        assert response.json()["code"] == "purchase_not_found"
    response = pay(stranger, quote_id, key="pay-0005-eeeeeeeeeeee")
    assert response.json()["code"] == "quote_not_found"


def test_result_is_202_while_running_then_delivered_with_a_receipt(
    client_for_buyer, buyer, offering
):
    ref = pay(client_for_buyer, new_quote(client_for_buyer, offering)).json()["purchase"]
    pending = client_for_buyer.get(f"/api/v1/purchases/{ref}/result")
    assert pending.status_code == 202
    assert pending["Retry-After"] == "2"
    assert pending.json()["execution"]["state"] == "queued"

    purchase = Purchase.objects.get(ref=ref)
    assert purchase_execute(purchase_id=purchase.pk, worker="test") == ExecutionOutcome.SUCCEEDED

    result = client_for_buyer.get(f"/api/v1/purchases/{ref}/result")
    assert result.status_code == 200
    assert result["Content-Type"] == "application/json"
    report = result.json()
    assert report["title"] == "Sales"
    digest = hashlib.sha256(result.content).hexdigest()

    status = client_for_buyer.get(f"/api/v1/purchases/{ref}").json()
    assert status["execution"]["state"] == "succeeded"
    assert status["delivery"]["state"] == "delivered"
    assert status["next_action"] == "fetch_result"
    receipt_url = status["links"]["receipt"]
    from rest_framework.test import APIClient

    receipt = APIClient().get(receipt_url).json()  # public: no key needed
    assert receipt["purchase"] == ref
    assert receipt["body_sha256"] == digest
    assert receipt["amount"] == "250000"
    assert receipt["payer"] == buyer.ref
    assert receipt["network"] == "prepaid"
    assert KEY not in str(receipt)  # never a client-supplied id in clear
    assert Receipt.objects.count() == 1


def test_result_after_retention_is_result_expired_with_the_receipt(client_for_buyer, offering):
    ref = pay(client_for_buyer, new_quote(client_for_buyer, offering)).json()["purchase"]
    purchase = Purchase.objects.get(ref=ref)
    purchase_execute(purchase_id=purchase.pk, worker="test")
    purchase.result.__class__.objects.filter(pk=purchase.result.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    response = client_for_buyer.get(f"/api/v1/purchases/{ref}/result")
    assert response.status_code == 410
    assert response.json()["code"] == "result_expired"
    assert response.json()["receipt"] == f"/api/v1/receipts/{purchase.receipt.public_id}"
    assert client_for_buyer.get(f"/api/v1/purchases/{ref}").json()["next_action"] == "use_receipt"


def test_unknown_receipt_is_404():
    from rest_framework.test import APIClient

    response = APIClient().get("/api/v1/receipts/rcp_nothing")
    assert response.status_code == 404
    assert response.json()["code"] == "receipt_not_found"
