"""The duplicate window on the prepaid rail: a new Idempotency-Key for what the buyer already
bought is answered with that purchase, marked as such, and debited once."""

from __future__ import annotations

from datetime import timedelta

import pytest

from payments.models import LedgerEntry
from purchases.models import Purchase, PurchaseEvent, Quote
from tests.conftest import CSV_INPUT

pytestmark = pytest.mark.django_db


def _quote(client, offering, data=None) -> str:
    response = client.post(
        "/api/v1/quotes", {"offering": offering.slug, "input": data or CSV_INPUT}, format="json"
    )
    assert response.status_code in (200, 201), response.content
    return response.json()["id"]


def _pay(client, quote_id, key, **headers):
    return client.post(
        f"/api/v1/quotes/{quote_id}/purchase",
        {"rail": "prepaid"},
        format="json",
        HTTP_IDEMPOTENCY_KEY=key,
        **headers,
    )


def _debits(buyer) -> int:
    return LedgerEntry.objects.filter(buyer=buyer, kind=LedgerEntry.Kind.PURCHASE_DEBIT).count()


def test_new_key_for_the_same_input_returns_the_existing_purchase(
    client_for_buyer, buyer, offering
):
    first = _pay(client_for_buyer, _quote(client_for_buyer, offering), "pay-dup-0001-aaaaaaaa")
    assert first.status_code == 201
    ref = first.json()["purchase"]
    # The quote was accepted: asking again opens a new quote for the same input.
    second_quote = _quote(client_for_buyer, offering)
    second = _pay(client_for_buyer, second_quote, "pay-dup-0002-bbbbbbbb")
    assert second.status_code == 200, second.content
    assert second.json()["purchase"] == ref and second.json()["duplicate_of"] == ref
    assert second["Tollbooth-Duplicate-Of"] == ref
    assert second["Location"] == f"/api/v1/purchases/{ref}"
    assert _debits(buyer) == 1 and Purchase.objects.count() == 1
    assert Quote.objects.get(public_id=second_quote).state == Quote.State.EXPIRED
    assert (
        PurchaseEvent.objects.filter(subject="purchase.duplicate", purchase__ref=ref).count() == 1
    )

    replay = _pay(client_for_buyer, second_quote, "pay-dup-0002-bbbbbbbb")
    assert replay.status_code == 200 and replay["Idempotent-Replayed"] == "true"
    assert replay.json() == second.json() and _debits(buyer) == 1


def test_same_quote_new_key_is_the_same_purchase(client_for_buyer, buyer, offering):
    quote_id = _quote(client_for_buyer, offering)
    first = _pay(client_for_buyer, quote_id, "pay-dup-0003-cccccccc").json()
    second = _pay(client_for_buyer, quote_id, "pay-dup-0004-dddddddd")
    assert second.status_code == 200 and second.json()["duplicate_of"] == first["purchase"]
    assert _debits(buyer) == 1


def test_copy_label_other_input_or_closed_window_buy_again(client_for_buyer, buyer, offering):
    _pay(client_for_buyer, _quote(client_for_buyer, offering), "pay-dup-0005-eeeeeeee")
    copy = _pay(
        client_for_buyer,
        _quote(client_for_buyer, offering),
        "pay-dup-0006-ffffffff",
        HTTP_TOLLBOOTH_COPY="2",
    )
    assert copy.status_code == 201 and _debits(buyer) == 2
    retried_copy = _pay(
        client_for_buyer,
        _quote(client_for_buyer, offering),
        "pay-dup-0007-gggggggg",
        HTTP_TOLLBOOTH_COPY="2",
    )
    assert retried_copy.json()["duplicate_of"] == copy.json()["purchase"] and _debits(buyer) == 2

    other = _quote(client_for_buyer, offering, {**CSV_INPUT, "title": "Other"})
    assert _pay(client_for_buyer, other, "pay-dup-0008-hhhhhhhh").status_code == 201
    assert _debits(buyer) == 3

    Purchase.objects.update(created_at=Purchase.objects.first().created_at - timedelta(hours=1))
    late = _pay(client_for_buyer, _quote(client_for_buyer, offering), "pay-dup-0009-iiiiiiii")
    assert late.status_code == 201 and _debits(buyer) == 4  # past the 10-minute window


def test_another_buyer_is_never_a_duplicate(client_for_buyer, buyer, offering, make_client):
    from tests.factories import BuyerFactory, fund

    other_buyer = BuyerFactory.create()
    fund(other_buyer, 1_000_000)
    other = make_client(other_buyer)
    _pay(client_for_buyer, _quote(client_for_buyer, offering), "pay-dup-0010-jjjjjjjj")
    theirs = _pay(other, _quote(other, offering), "pay-dup-0011-kkkkkkkk")
    assert theirs.status_code == 201 and "duplicate_of" not in theirs.json()
    assert Purchase.objects.count() == 2
