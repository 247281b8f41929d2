"""Prepaid balances topped up over x402 (issue 34, part 3; docs/x402.md#top-ups): the amount
is in the URL, the API key names the balance, the credit is posted once, with the result, once
the payment is settled; the balance is read back through GET /api/v1/balance."""

from __future__ import annotations

import json

import pytest
from django.db import transaction
from rest_framework.test import APIClient
from x402.http.utils import decode_payment_required_header
from x402.schemas import PaymentRequired, PaymentRequirements

from payments.models import LedgerEntry, PaymentAttempt
from purchases.models import Offering, Purchase, Quote
from purchases.services.fulfil.execution import ExecutionOutcome, purchase_execute
from purchases.services.fulfil.top_ups import top_up_credit
from purchases.services.shared.buyers import api_key_issue
from tests.factories import BuyerFactory, OfferingFactory, PurchaseFactory, fund
from tests.x402.e2e import NETWORK, MakeWorld, X402World, sign_payment

# Also run on the embedded SQLite default (`make test`'s second pass).
pytestmark = [pytest.mark.django_db, pytest.mark.embedded]
AMOUNT = 2_500_000  # 2.50 USDC


@pytest.fixture
def world(make_x402_world: MakeWorld, settings) -> X402World:
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "TOP_UP_MIN": 100_000, "TOP_UP_MAX": 50_000_000}
    return make_x402_world(
        offering={
            "slug": "top-up",
            "top_up": True,
        }
    )


@pytest.fixture
def buyer():
    return BuyerFactory.create()


@pytest.fixture
def keyed(buyer) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_issue(buyer=buyer)}")
    return client


def balance(client: APIClient, asset: str) -> int:
    response = client.get("/api/v1/balance")
    assert response.status_code == 200, response.content
    amounts = {row["asset"]: int(row["amount"]) for row in response.json()["balances"]}
    return amounts.get(asset, 0)


def accepted(response) -> PaymentRequirements:
    required = decode_payment_required_header(response["PAYMENT-REQUIRED"])
    assert isinstance(required, PaymentRequired)
    (accept,) = required.accepts
    return accept


def test_the_402_asks_for_exactly_the_amount_in_the_url(world, keyed):
    response = keyed.get(f"{world.paid_url}?amount={AMOUNT}")
    assert response.status_code == 402, response.content
    accept = accepted(response)
    assert (accept.amount, accept.network, accept.asset) == (str(AMOUNT), NETWORK, world.token)
    quote = Quote.objects.get(public_id=response.json()["quote"])
    assert (quote.price, quote.canonical_input, quote.buyer.api_keys.count()) == (
        AMOUNT,
        {"amount": AMOUNT},
        1,
    )
    # The same amount again: the same quote; another amount: a quote of its own.
    again = keyed.get(f"{world.paid_url}?amount={AMOUNT}")
    assert again.json()["quote"] == quote.public_id
    other = keyed.post(world.paid_url, {"amount": AMOUNT + 1}, format="json")
    assert accepted(other).amount == str(AMOUNT + 1) and other.json()["quote"] != quote.public_id


@pytest.mark.parametrize(
    "query",
    [
        "amount=99999",
        "amount=50000001",
        "amount=1.5",
        "amount=-5",
        "amount=abc",
        "",
        "amount=1e6",
        "amount=1000000&memo=x",
    ],
)
def test_amounts_outside_the_limits_or_malformed_are_a_clear_422(world, keyed, query):
    response = keyed.get(f"{world.paid_url}?{query}")
    assert response.status_code == 422, response.content
    body = response.json()
    assert body["code"] == "invalid_input"
    assert (body["minimum"], body["maximum"]) == ("100000", "50000000")
    assert not Quote.objects.exists()


@pytest.mark.parametrize("amount", [1.5, True, None, "1000000.0", [1000000]])
def test_a_json_amount_that_is_not_whole_atomic_units_is_a_422(world, keyed, amount):
    response = keyed.post(world.paid_url, {"amount": amount}, format="json")
    assert response.status_code == 422, response.content
    assert not Quote.objects.exists()


def test_without_an_api_key_nothing_is_offered(world):
    response = APIClient().get(f"{world.paid_url}?amount={AMOUNT}")
    assert response.status_code == 401, response.content
    assert response.json()["code"] == "not_authenticated"
    assert not Quote.objects.exists()
    # HEAD stays the price-only 402 (writes nothing), as for every paid URL.
    assert APIClient().head(world.paid_url).status_code == 402


def test_a_top_up_is_never_paid_from_the_balance_it_credits(world, buyer, keyed):
    fund(buyer, 10_000_000, asset=world.token)
    quote = keyed.post(
        "/api/v1/quotes", {"offering": "top-up", "input": {"amount": AMOUNT}}, format="json"
    )
    assert quote.status_code == 201, quote.content
    paid = keyed.post(
        f"/api/v1/quotes/{quote.json()['id']}/purchase",
        {"rail": "prepaid"},
        format="json",
        HTTP_IDEMPOTENCY_KEY="top-up-from-balance-1",
    )
    assert paid.status_code == 400 and paid.json()["code"] == "unsupported_rail", paid.content
    assert balance(keyed, world.token) == 10_000_000
    assert not Purchase.objects.exists()


def test_paid_top_up_credits_once_with_the_balance_and_a_signed_receipt(world, buyer, keyed):
    fund(buyer, 1_000_000, asset=world.token)
    payer = world.payers[0]
    url = f"{world.paid_url}?amount={AMOUNT}"
    offer = keyed.get(url)
    payment = sign_payment(offer["PAYMENT-REQUIRED"], payer, None)
    first = keyed.get(url, HTTP_PAYMENT_SIGNATURE=payment)
    # Settled on chain; the credit is the work, queued (no worker here): 202, nothing credited.
    assert first.status_code == 202, first.content
    assert world.seller_balance() == AMOUNT
    assert balance(keyed, world.token) == 1_000_000
    purchase = Purchase.objects.get()
    assert (purchase.buyer, purchase.amount, purchase.payment_state) == (buyer, AMOUNT, "paid")

    assert purchase_execute(purchase_id=purchase.pk, worker="t") == ExecutionOutcome.SUCCEEDED
    assert purchase_execute(purchase_id=purchase.pk, worker="t") == ExecutionOutcome.OBSERVED
    assert balance(keyed, world.token) == 1_000_000 + AMOUNT
    (entry,) = LedgerEntry.objects.filter(kind=LedgerEntry.Kind.TOP_UP, purchase=purchase)
    assert (entry.buyer, entry.amount, entry.asset) == (buyer, AMOUNT, world.token)
    assert entry.reference == f"top_up:{purchase.ref}"

    again = keyed.get(url, HTTP_PAYMENT_SIGNATURE=payment)  # the same payment, resent
    assert again.status_code == 200, again.content
    assert again.json() == {
        "top_up": {
            "purchase": purchase.ref,
            "credited": str(AMOUNT),
            "asset": world.token,
            "ledger_reference": entry.reference,
            "balance": str(1_000_000 + AMOUNT),
        }
    }
    assert again["Tollbooth-Receipt"]
    # A re-signed retry (new nonce) inside the duplicate window: the same top-up, not paid.
    offer = keyed.get(url)
    resigned = keyed.get(
        url, HTTP_PAYMENT_SIGNATURE=sign_payment(offer["PAYMENT-REQUIRED"], payer, None)
    )
    assert resigned.status_code == 200, resigned.content
    assert resigned.json() == again.json()
    assert resigned["Tollbooth-Duplicate-Of"] == purchase.ref
    assert world.seller_balance() == AMOUNT and world.relayer_sent() == 1
    assert balance(keyed, world.token) == 1_000_000 + AMOUNT
    assert PaymentAttempt.objects.count() == 1 and Purchase.objects.count() == 1


def test_another_buyer_cannot_pay_into_a_quote_it_does_not_own(world, keyed):
    offer = keyed.get(f"{world.paid_url}?amount={AMOUNT}")
    payment = sign_payment(offer["PAYMENT-REQUIRED"], world.payers[1], None)
    stranger = APIClient()
    stranger.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_issue(buyer=BuyerFactory.create())}")
    response = stranger.get(f"{world.paid_url}?amount={AMOUNT}", HTTP_PAYMENT_SIGNATURE=payment)
    assert response.status_code == 404, response.content
    assert response.json()["code"] == "quote_not_found"
    assert world.seller_balance() == 0 and not Purchase.objects.exists()


def test_a_top_up_runs_only_on_a_settled_payment_even_if_told_verified(db):
    told = {"delivery_condition": Offering.DeliveryCondition.VERIFIED}
    top_up = PurchaseFactory.create(
        quote__offering=OfferingFactory.create(top_up=True, **told), settlement_pending=True
    )
    assert top_up.is_payment_sufficient_for_execution() is False
    other = PurchaseFactory.create(
        quote__offering=OfferingFactory.create(**told), settlement_pending=True
    )
    assert other.is_payment_sufficient_for_execution() is True


def test_a_top_up_told_to_settle_after_the_work_still_settles_first(world, keyed):
    """Its credit can be spent at once: never held, and its 402 says upfront."""
    Offering.objects.filter(pk=world.offering.pk).update(
        delivery_condition=Offering.DeliveryCondition.AUTHORIZATION
    )
    world.offering.refresh_from_db()
    assert world.offering.settles_after_work is False
    response = keyed.get(f"{world.paid_url}?amount={AMOUNT}")
    assert accepted(response).extra["paymentFlow"] == "upfront"


def _pay_and_credit(world: X402World, client: APIClient, url: str, copy: str = "") -> Purchase:
    offer = client.get(url)
    payment = sign_payment(offer["PAYMENT-REQUIRED"], world.payers[0], None)
    if copy:
        paid = client.get(url, HTTP_PAYMENT_SIGNATURE=payment, HTTP_TOLLBOOTH_COPY=copy)
    else:
        paid = client.get(url, HTTP_PAYMENT_SIGNATURE=payment)
    assert paid.status_code == 202, paid.content
    purchase = Purchase.objects.get(ref=paid.json()["purchase"])
    assert purchase_execute(purchase_id=purchase.pk, worker="t") == ExecutionOutcome.SUCCEEDED
    return purchase


def test_the_same_amount_again_on_purpose_is_a_copy_label(world, keyed):
    url = f"{world.paid_url}?amount={AMOUNT}"
    first = _pay_and_credit(world, keyed, url)
    second = _pay_and_credit(world, keyed, url, copy="second")
    assert second.pk != first.pk
    assert balance(keyed, world.token) == 2 * AMOUNT
    assert world.seller_balance() == 2 * AMOUNT
    assert LedgerEntry.objects.filter(kind=LedgerEntry.Kind.TOP_UP).count() == 2


def test_a_second_credit_of_one_top_up_posts_nothing(world, buyer, keyed):
    purchase = _pay_and_credit(world, keyed, f"{world.paid_url}?amount={AMOUNT}")
    with transaction.atomic():
        again = top_up_credit(purchase=Purchase.objects.get(pk=purchase.pk))
    assert json.loads(again.content)["top_up"]["balance"] == str(AMOUNT)
    assert LedgerEntry.objects.filter(buyer=buyer).count() == 1
    assert balance(keyed, world.token) == AMOUNT


def test_the_offerings_list_shows_what_a_top_up_takes(world, keyed):
    listed = {o["offering"]: o for o in keyed.get("/api/v1/offerings").json()["offerings"]}
    amount = listed["top-up"]["input_schema"]["properties"]["amount"]
    assert (amount["type"], amount["minimum"], amount["maximum"]) == (
        "integer",
        100_000,
        50_000_000,
    )
