"""A client's payment id binds to the request, not to one signature (x402 docs PR #2307).

Clients that send a payment id re-sign on retry and keep the id. The same id from the same
payer for the same offering and input, paying the same amount to the same recipient, is the
same request: answered with its purchase (result, pending or in flight), never charged again.
Another payer, input, amount or recipient under that id stays `409
payment_identifier_conflict`. On a real anvil chain; the duplicate window is off, so only
the id protects the buyer here.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient
from x402.http.utils import decode_payment_signature_header

from payments.chain.token import authorization_state
from payments.models import PaymentAttempt
from payments.rails.x402.rail import x402_presentation
from purchases import event_subjects as subjects
from purchases.models import IdempotencyRecord, Offering, Purchase, PurchaseEvent
from tests.x402.e2e import PRICE, ask, sign_payment

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]
PAY_ID = "x402-retry-id-00000001"
OTHER_INPUT = {"title": "Other", "csv": "region,units\nsouth,9\n"}


@pytest.fixture
def client() -> APIClient:
    return APIClient()


@pytest.fixture
def world(x402_world):
    Offering.objects.update(duplicate_window=timedelta(0))
    return x402_world


def _signed(client, world, payer_index=0, data=None, **options) -> str:
    """What a client with the payment-id hook does on each call: a new 402, a new
    signature (new nonce), the same id."""
    required = ask(client, world, data)
    assert required.status_code == 402, required.content
    return sign_payment(required["PAYMENT-REQUIRED"], world.payers[payer_index], PAY_ID, **options)


def _nonce(payment: str) -> str:
    return decode_payment_signature_header(payment).payload["authorization"]["nonce"]


def test_resigned_retry_with_the_same_id_is_answered_with_its_purchase(client, world):
    first = ask(client, world, payment=_signed(client, world))
    assert first.status_code == 202, first.content
    purchase = Purchase.objects.get()

    retry_payment = _signed(client, world)  # a fresh quote, a fresh authorization, same id
    retry = ask(client, world, payment=retry_payment)

    assert retry.status_code == 202, retry.content
    assert retry.json()["purchase"] == purchase.ref
    assert retry["Location"] == first["Location"]
    assert "Tollbooth-Duplicate-Of" not in retry  # the same request, not a repeat of it
    # Never charged again: one attempt, one broadcast, one transfer; the new nonce unused.
    assert PaymentAttempt.objects.count() == 1 and IdempotencyRecord.objects.count() == 1
    assert world.relayer_sent() == 1 and world.seller_balance() == PRICE
    payer = world.payers[0].address
    assert authorization_state(world.w3, world.token, payer, _nonce(retry_payment)) is False
    replayed = PurchaseEvent.objects.get(purchase=purchase, subject=subjects.PAYMENT_ID_REPLAYED)
    assert replayed.evidence["request_matches"] is True


@pytest.mark.parametrize(
    "change",
    ["another payer", "another input", "another amount", "another recipient"],
)
def test_same_id_for_another_payer_input_amount_or_recipient_is_a_conflict(client, world, change):
    assert ask(client, world, payment=_signed(client, world)).status_code == 202
    other = world.new_account().address
    changed = {
        "another payer": lambda: _signed(client, world, payer_index=1),
        "another input": lambda: _signed(client, world, data=OTHER_INPUT),
        "another amount": lambda: _signed(
            client, world, value=PRICE + 1, accepted_overrides={"amount": str(PRICE + 1)}
        ),
        "another recipient": lambda: _signed(
            client, world, to=other, accepted_overrides={"pay_to": other}
        ),
    }[change]()

    # Sent as a client retries: with the input its quote was offered for.
    conflict = ask(
        client, world, OTHER_INPUT if change == "another input" else None, payment=changed
    )

    assert conflict.status_code == 409, conflict.content
    assert conflict.json()["code"] == "payment_identifier_conflict"
    assert conflict.json()["purchase"] is None  # never names the other request's purchase
    assert PaymentAttempt.objects.count() == 1 and Purchase.objects.count() == 1
    assert world.relayer_sent() == 1 and world.seller_balance() == PRICE


def test_resigned_retry_while_the_first_request_runs_is_in_flight_naming_it(client, world):
    assert ask(client, world, payment=_signed(client, world)).status_code == 202
    purchase = Purchase.objects.get()
    # The first request still holds the id (as while it waits for the chain), in another
    # process whose heartbeat renews the lease (purchases/services/checkout/leases.py).
    IdempotencyRecord.objects.update(
        state=IdempotencyRecord.State.IN_FLIGHT,
        locked_until=timezone.now() + timedelta(seconds=60),
        lease_token="another-process.its-request",
    )

    retry = ask(client, world, payment=_signed(client, world))

    assert retry.status_code == 409, retry.content
    assert retry.json()["code"] == "payment_in_flight"
    assert retry.json()["purchase"] == purchase.ref
    assert retry["Retry-After"]
    assert PaymentAttempt.objects.count() == 1 and world.relayer_sent() == 1


def test_an_id_recorded_before_normalized_fingerprints_still_replays_its_exact_payload(
    client, world
):
    payment = _signed(client, world)
    assert ask(client, world, payment=payment).status_code == 202
    # Recorded before this rule: the key holds the whole payload's fingerprint.
    IdempotencyRecord.objects.update(
        request_fingerprint=x402_presentation(header=payment).fingerprint
    )

    again = ask(client, world, payment=payment)

    assert again.status_code == 202, again.content
    assert again.json()["purchase"] == Purchase.objects.get().ref
    assert world.relayer_sent() == 1 and PaymentAttempt.objects.count() == 1
