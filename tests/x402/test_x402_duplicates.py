"""Stock-client safety on a real anvil chain: payments keyed without an id, re-signed retries
answered inside the duplicate window (never charged), deliberate copies, and the race."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import requests
from django.utils import timezone
from rest_framework.test import APIClient
from x402.http.utils import decode_payment_signature_header, encode_payment_signature_header
from x402.schemas import PaymentPayload

from core.canonical import sha256_hex
from doors.x402.answers import X402Answers
from payments.chain.token import authorization_state
from payments.models import PaymentAttempt
from purchases.models import IdempotencyRecord, Offering, Purchase, PurchaseEvent
from purchases.services.checkout.flow import PaymentPending
from purchases.services.fulfil.execution import purchase_execute
from purchases.services.x402.checkout import x402_pay
from tests.integration.helpers import race
from tests.x402.e2e import NETWORK, PRICE, sign_payment

INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\n"}


@pytest.fixture
def client() -> APIClient:
    return APIClient()


def _fresh_payment(client, world, payer_index: int = 0, **headers: str) -> str:
    """What a stock client does on every call: a new 402, a new signature, no payment id."""
    required = client.post(world.paid_url, INPUT, format="json", **headers)
    assert required.status_code == 402, required.content
    return sign_payment(required["PAYMENT-REQUIRED"], world.payers[payer_index], None)


def _pay(client, world, payment: str, **headers):
    return client.post(
        world.paid_url, INPUT, format="json", HTTP_PAYMENT_SIGNATURE=payment, **headers
    )


def _nonce(payment: str) -> str:
    return decode_payment_signature_header(payment).payload["authorization"]["nonce"]


@pytest.mark.django_db
def test_payment_without_id_is_keyed_by_network_payer_and_nonce(client, x402_world):
    world = x402_world
    payment = _fresh_payment(client, world)
    first = _pay(client, world, payment)
    assert first.status_code == 202, first.content
    payer = world.payers[0].address.lower()
    expected_key = "auth:" + sha256_hex(f"{NETWORK}|{payer}|{_nonce(payment).lower()}")
    record = IdempotencyRecord.objects.get()
    assert record.key == expected_key and record.principal == payer
    assert PaymentAttempt.objects.get().idempotency_record == record

    again = _pay(client, world, payment)  # the same PAYMENT-SIGNATURE resent
    assert again.status_code == 202 and again.json()["purchase"] == first.json()["purchase"]
    assert "Tollbooth-Duplicate-Of" not in again  # a replay of the same payment, not a duplicate
    assert PaymentAttempt.objects.count() == 1 and IdempotencyRecord.objects.count() == 1
    assert world.relayer_sent() == 1 and world.seller_balance() == PRICE


@pytest.mark.django_db
@pytest.mark.parametrize("bad_id", ["short", "x" * 16 + "\n", "a" * 129, 12345678901234567])
def test_malformed_payment_identifier_speaks_of_the_identifier(client, x402_world, bad_id):
    required = client.post(x402_world.paid_url, INPUT, format="json")
    payment = sign_payment(required["PAYMENT-REQUIRED"], x402_world.payers[0], None)
    document = decode_payment_signature_header(payment)
    assert isinstance(document, PaymentPayload)
    document.extensions = {"payment-identifier": {"info": {"required": False, "id": bad_id}}}
    response = _pay(client, x402_world, encode_payment_signature_header(document))
    assert response.status_code == 400
    assert response.json()["code"] == "payment_identifier_invalid"
    assert "payment identifier" in response.json()["title"]
    assert "Idempotency-Key" not in response.json()["title"]
    assert x402_world.relayer_sent() == 0 and not IdempotencyRecord.objects.exists()


@pytest.mark.django_db
def test_a_duplicate_of_a_purchase_still_paying_points_at_it(client, x402_world):
    """A re-signed retry while the first request still pays: 409 payment_in_flight with the
    status URL in Location and the purchase in Tollbooth-Duplicate-Of, as docs/x402.md says,
    and a title that does not speak of a payment id the client never sent."""
    world = x402_world
    first = _pay(client, world, _fresh_payment(client, world))
    assert first.status_code == 202
    purchase = Purchase.objects.get()
    # Its own request still runs: paying, its key leased.
    Purchase.objects.update(payment_state=Purchase.PaymentState.PAYING)
    IdempotencyRecord.objects.update(
        state=IdempotencyRecord.State.IN_FLIGHT,
        locked_until=timezone.now() + timedelta(seconds=60),
    )

    retry = _pay(client, world, _fresh_payment(client, world))

    assert retry.status_code == 409, retry.content
    body = retry.json()
    assert body["code"] == "payment_in_flight" and body["purchase"] == purchase.ref
    assert retry["Location"] == body["status_url"] == first["Location"]
    assert retry["Tollbooth-Duplicate-Of"] == purchase.ref
    assert retry["Retry-After"]
    assert "payment id" not in body["title"] and "payment id" not in body["detail"]
    assert world.relayer_sent() == 1 and PaymentAttempt.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("with_key", [False, True], ids=["anonymous", "api-key"])
def test_resigned_retry_inside_the_window_is_answered_never_charged(
    client, x402_world, buyer, make_client, with_key
):
    world = x402_world
    client = make_client(buyer) if with_key else client
    first = _pay(client, world, _fresh_payment(client, world))
    assert first.status_code == 202
    ref = first.json()["purchase"]

    retry_payment = _fresh_payment(client, world)  # timed out: new 402, new nonce
    retry = _pay(client, world, retry_payment)
    assert retry.status_code == 202, retry.content
    assert retry.json()["purchase"] == ref
    assert retry["Tollbooth-Duplicate-Of"] == ref
    assert world.relayer_sent() == 1 and world.seller_balance() == PRICE
    # The retry's authorization was never sent: its nonce is still unused on chain.
    payer = world.payers[0].address
    assert authorization_state(world.w3, world.token, payer, _nonce(retry_payment)) is False
    assert Purchase.objects.count() == 1 and PaymentAttempt.objects.count() == 1
    event = PurchaseEvent.objects.get(subject="purchase.duplicate")
    assert event.purchase is not None and event.purchase.ref == ref
    assert event.evidence["nonce"] == _nonce(retry_payment)

    purchase_execute(purchase_id=Purchase.objects.get().pk, worker="test")
    third = _pay(client, world, _fresh_payment(client, world))
    assert third.status_code == 200 and third.json()["title"] == "Sales"
    assert third["Tollbooth-Duplicate-Of"] == ref
    assert world.relayer_sent() == 1 and world.seller_balance() == PRICE


@pytest.mark.django_db
def test_a_copy_label_buys_a_second_copy_and_its_retries_are_still_answered(client, x402_world):
    world = x402_world
    first = _pay(client, world, _fresh_payment(client, world))
    copy = {"HTTP_TOLLBOOTH_COPY": "second"}
    second = _pay(client, world, _fresh_payment(client, world, 0, **copy), **copy)
    assert second.status_code == 202 and second.json()["purchase"] != first.json()["purchase"]
    assert world.seller_balance() == 2 * PRICE

    retried = _pay(client, world, _fresh_payment(client, world, 0, **copy), **copy)
    assert retried["Tollbooth-Duplicate-Of"] == second.json()["purchase"]
    assert world.seller_balance() == 2 * PRICE and world.relayer_sent() == 2

    invalid = _pay(client, world, _fresh_payment(client, world), HTTP_TOLLBOOTH_COPY="no spaces")
    assert invalid.status_code == 400 and invalid.json()["code"] == "copy_label_invalid"
    assert world.seller_balance() == 2 * PRICE


@pytest.mark.django_db
def test_window_zero_and_other_inputs_are_new_purchases(client, x402_world):
    world = x402_world
    _pay(client, world, _fresh_payment(client, world))
    other_input = {**INPUT, "title": "Other"}
    other = client.post(world.paid_url, other_input, format="json")
    payment = sign_payment(other["PAYMENT-REQUIRED"], world.payers[0], None)
    # Paid as a client retries: with the input it was quoted for.
    paid = client.post(world.paid_url, other_input, format="json", HTTP_PAYMENT_SIGNATURE=payment)
    assert paid.status_code == 202
    assert world.seller_balance() == 2 * PRICE  # another input is another purchase

    Offering.objects.update(duplicate_window=timedelta(0))
    assert _pay(client, world, _fresh_payment(client, world)).status_code == 202
    assert world.seller_balance() == 3 * PRICE  # window off: buying twice is normal
    assert not PurchaseEvent.objects.filter(subject="purchase.duplicate").exists()


@pytest.mark.django_db
def test_window_zero_never_repeats_a_purchase_recorded_while_the_request_ran(client, x402_world):
    """The race of two payments of one quote, without threads: the second request began
    before the first was recorded. Window off, it is refused, never that purchase's repeat."""
    world = x402_world
    Offering.objects.update(duplicate_window=timedelta(0))
    header = client.post(world.paid_url, INPUT, format="json")["PAYMENT-REQUIRED"]
    began_at = timezone.now()
    first = _pay(client, world, sign_payment(header, world.payers[0], None))
    assert first.status_code == 202, first.content

    answer = x402_pay(
        offering_slug=Offering.objects.get().slug,
        payment_header=sign_payment(header, world.payers[0], None),
        buyer=None,
        answers=X402Answers(),
        now=began_at,
    )
    assert not isinstance(answer, PaymentPending)  # nothing settles: no wait comes back
    assert answer.status == 402, answer
    refusal = json.loads(answer.body)
    assert refusal["code"] == "quote_already_paid"
    assert refusal["existing_purchase"] == first.json()["purchase"]
    assert "Tollbooth-Duplicate-Of" not in answer.headers
    assert not PurchaseEvent.objects.filter(subject="purchase.duplicate").exists()
    assert Purchase.objects.count() == 1 and world.relayer_sent() == 1


@pytest.mark.django_db
def test_a_failed_purchase_is_not_repeated(client, x402_world):
    world = x402_world
    first = _pay(client, world, _fresh_payment(client, world))
    Purchase.objects.filter(ref=first.json()["purchase"]).update(payment_state="failed")
    again = _pay(client, world, _fresh_payment(client, world))
    assert again.status_code == 202 and again.json()["purchase"] != first.json()["purchase"]
    assert world.seller_balance() == 2 * PRICE


@pytest.mark.sqlite_concurrency
@pytest.mark.django_db(transaction=True)
def test_eight_fresh_authorizations_at_once_settle_exactly_one(x402_live_world, http_server):
    world = x402_live_world
    url = f"{http_server}{world.paid_url}"
    payments = []
    for _ in range(8):  # eight stock clients (or retries) of one payer, each with its own 402
        required = requests.post(url, json=INPUT, timeout=10)
        payments.append(sign_payment(required.headers["PAYMENT-REQUIRED"], world.payers[0], None))
    answers = race(
        8,
        lambda i: requests.post(
            url, json=INPUT, headers={"PAYMENT-SIGNATURE": payments[i]}, timeout=60
        ),
    )
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1
    (purchase,) = Purchase.objects.all()
    for answer in answers:
        assert answer.status_code in (202, 409), answer.text
        assert answer.json()["purchase"] == purchase.ref, answer.text
        if answer.status_code == 409:
            assert answer.json()["code"] == "payment_in_flight" and answer.headers["Retry-After"]
            assert answer.headers["Tollbooth-Duplicate-Of"] == purchase.ref
            assert answer.headers["Location"] == answer.json()["status_url"]
    in_flight = [a for a in answers if a.status_code == 409]
    duplicates = [a for a in answers if a.headers.get("Tollbooth-Duplicate-Of")]
    duplicates = [a for a in duplicates if a.status_code != 409]
    assert len(duplicates) + len(in_flight) == 7
    assert PurchaseEvent.objects.filter(subject="purchase.duplicate").count() == len(duplicates)


@pytest.mark.sqlite_concurrency
@pytest.mark.django_db(transaction=True)
def test_one_signature_without_id_sent_at_once_is_in_flight_not_paid_twice(
    x402_live_world, http_server
):
    world = x402_live_world
    url = f"{http_server}{world.paid_url}"
    required = requests.post(url, json=INPUT, timeout=10)
    payment = sign_payment(required.headers["PAYMENT-REQUIRED"], world.payers[0], None)
    answers = race(
        6,
        lambda i: requests.post(
            url, json=INPUT, headers={"PAYMENT-SIGNATURE": payment}, timeout=60
        ),
    )
    assert {a.status_code for a in answers} <= {202, 409}, [a.text for a in answers]
    for answer in answers:
        if answer.status_code == 409:
            assert answer.json()["code"] == "payment_in_flight" and answer.headers["Retry-After"]
    assert PaymentAttempt.objects.count() == 1 and IdempotencyRecord.objects.count() == 1
    assert IdempotencyRecord.objects.get().key.startswith("auth:")
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1
