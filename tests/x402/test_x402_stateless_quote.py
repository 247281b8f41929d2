"""An unpaid anonymous 402 writes nothing (issue 22 §4): the quote's terms travel signed in
`accepts[].extra.signedQuote` and the quote is written with the purchase. Keyed buyers keep
their stored, deterministic quote; offerings with stock keep writing theirs."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import requests
from django.apps import apps
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from eth_account import Account
from rest_framework.test import APIClient
from x402.http.utils import decode_payment_required_header

from core.canonical import canonical_json, sha256_hex
from devtools.test_token import mint
from payments.chain.token import balance_of
from payments.models import PaymentAttempt
from purchases.models import Offering, Purchase, PurchaseEvent, Quote
from purchases.services.x402.offers import x402_offer
from tests.x402.e2e import FUNDED, PRICE, ask, sign_payment

INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\n"}
OTHER = {"title": "Other", "csv": "region,units\nsouth,4\n"}
_WRITES = ("INSERT", "UPDATE", "DELETE")
# Statements of one anonymous 402 (POST with a valid input): the offering's read, nothing
# written. Before issue 22 §4 it was 3 (the read, the quote's INSERT, its event's INSERT)
# inside a transaction, plus the SAVEPOINT pair in tests.
ANONYMOUS_402_CEILING = 1


@pytest.fixture
def client() -> APIClient:
    return APIClient()


def _extra(response: Any) -> dict[str, Any]:
    required = decode_payment_required_header(response["PAYMENT-REQUIRED"])
    return dict(required.accepts[0].extra or {})


def _row_counts() -> dict[str, int]:
    return {model._meta.label: model._default_manager.count() for model in apps.get_models()}


def _nothing_recorded(world) -> None:
    assert not Purchase.objects.exists() and not PaymentAttempt.objects.exists()
    assert not Quote.objects.exists()
    assert world.relayer_sent() == 0


@pytest.mark.django_db
def test_an_anonymous_402_writes_no_row_by_post_get_or_the_mcp_door(client, x402_world):
    before = _row_counts()
    with CaptureQueriesContext(connection) as captured:
        posted = ask(client, x402_world)
        got = client.get(x402_world.paid_url, INPUT)
        offer = x402_offer(  # what the MCP door answers a tool call without payment
            offering_slug=x402_world.offering.slug,
            raw_input=INPUT,
            buyer=None,
            resource_url="http://testserver/mcp",
            sign_in=False,
        )
    assert posted.status_code == got.status_code == 402
    writes = [q["sql"] for q in captured.captured_queries if q["sql"].startswith(_WRITES)]
    assert writes == []
    assert _row_counts() == before  # every table, not only the quotes
    for extra in (_extra(posted), _extra(got), offer.document["accepts"][0]["extra"]):
        signed = extra["signedQuote"]
        assert signed["inputHash"] == sha256_hex(canonical_json(INPUT))
        assert signed["offeringVersion"] == x402_world.offering.version
        assert signed["signature"] and extra["quote"].startswith("qt_")


@pytest.mark.django_db
def test_anonymous_402_statement_budget(client, x402_world):
    ask(client, x402_world)  # warm: prepared statements, caches
    with CaptureQueriesContext(connection) as captured:
        assert ask(client, x402_world).status_code == 402
    statements = [
        q["sql"]
        for q in captured.captured_queries
        if not q["sql"].startswith(("SAVEPOINT", "RELEASE"))
    ]
    assert len(statements) <= ANONYMOUS_402_CEILING, "\n".join(statements)


@pytest.mark.django_db
def test_paying_a_signed_quote_writes_it_with_the_purchase(client, x402_world):
    required = ask(client, x402_world)
    extra = _extra(required)
    paid = ask(
        client,
        x402_world,
        payment=sign_payment(required["PAYMENT-REQUIRED"], x402_world.payers[0], None),
    )
    assert paid.status_code == 202, paid.content
    quote = Quote.objects.get()
    purchase = Purchase.objects.get()
    assert purchase.quote_id == quote.pk and quote.public_id == extra["quote"]
    assert (quote.state, quote.buyer_id, quote.canonical_input) == ("accepted", None, INPUT)
    assert quote.input_hash == extra["signedQuote"]["inputHash"]
    assert int(quote.expires_at.timestamp()) == extra["signedQuote"]["expiresAt"]
    assert (quote.price, quote.offering_version) == (PRICE, x402_world.offering.version)
    states = list(
        PurchaseEvent.objects.filter(subject="quote", quote=quote)
        .order_by("pk")
        .values_list("to_state", flat=True)
    )
    assert states == ["open", "accepted"]  # its timeline as a written quote's
    assert x402_world.seller_balance() == PRICE


@pytest.mark.django_db
def test_keyed_buyers_keep_their_stored_deterministic_quote(client_for_buyer, x402_world):
    first = ask(client_for_buyer, x402_world)
    second = ask(client_for_buyer, x402_world)
    assert first.json()["quote"] == second.json()["quote"]
    assert "signedQuote" not in _extra(first)
    quote = Quote.objects.get()
    assert quote.buyer_id is not None and quote.canonical_input == INPUT


@pytest.mark.django_db
def test_an_offering_with_stock_still_writes_its_quote_and_takes_stock_when_paid(
    client, x402_world
):
    Offering.objects.filter(pk=x402_world.offering.pk).update(stock=2)
    required = ask(client, x402_world)
    assert "signedQuote" not in _extra(required)
    quote = Quote.objects.get(public_id=required.json()["quote"])
    assert quote.state == "open" and not quote.holds_stock  # a free 402 holds no stock
    assert Offering.objects.get(pk=x402_world.offering.pk).stock == 2
    payment = sign_payment(required["PAYMENT-REQUIRED"], x402_world.payers[0], None)
    assert ask(client, x402_world, payment=payment).status_code == 202
    quote.refresh_from_db()
    assert quote.state == "accepted" and quote.holds_stock
    assert Offering.objects.get(pk=x402_world.offering.pk).stock == 1


def _tampered(required: Any, change: dict[str, Any]) -> dict[str, Any]:
    extra = _extra(required)
    signed = dict(extra["signedQuote"])
    for key, value in change.items():
        if key == "quote":
            extra["quote"] = value
        elif key == "signedQuote":
            extra["signedQuote"] = value
            return extra
        else:
            signed[key] = value
    extra["signedQuote"] = signed
    return extra


@pytest.mark.django_db
@pytest.mark.parametrize(
    "change",
    [
        {"inputHash": sha256_hex(canonical_json(OTHER))},
        {"expiresAt": 4_000_000_000},
        {"offeringVersion": 99},
        {"quote": "qt_someoneelses000000000"},
        {"signature": "not-our-signature"},
        {"signedQuote": "not an object"},
        {"expiresAt": "soon"},
        {"inputHash": "z" * 64},
    ],
    ids=["input", "expiry", "version", "quote", "signature", "shape", "type", "hash"],
)
def test_a_tampered_term_is_a_clear_4xx_and_records_nothing(client, x402_world, change):
    required = ask(client, x402_world)
    header = required["PAYMENT-REQUIRED"]
    payment = sign_payment(
        header,
        x402_world.payers[0],
        None,
        accepted_overrides={"extra": _tampered(required, change)},
    )
    body = OTHER if "inputHash" in change and change["inputHash"] != "z" * 64 else INPUT
    refused = ask(client, x402_world, body, payment=payment)
    assert refused.status_code == 400, refused.content
    assert refused.json()["code"] == "quote_terms_invalid"
    _nothing_recorded(x402_world)


@pytest.mark.django_db
def test_a_payment_without_the_quoted_input_is_input_mismatch(client, x402_world):
    required = ask(client, x402_world)
    payment = sign_payment(required["PAYMENT-REQUIRED"], x402_world.payers[0], None)
    refused = ask(client, x402_world, OTHER, payment=payment)
    assert refused.status_code == 409 and refused.json()["code"] == "input_mismatch"
    _nothing_recorded(x402_world)


@pytest.mark.django_db
def test_an_expired_signed_quote_is_answered_as_an_expired_written_one(
    client, x402_world, settings
):
    settings.X402_ANONYMOUS_QUOTE_TTL_SECONDS = 60
    past = timezone.now() - timedelta(minutes=5)
    slug = x402_world.offering.slug

    def offer() -> str:
        return x402_offer(
            offering_slug=slug,
            raw_input=INPUT,
            buyer=None,
            resource_url="http://testserver",
            now=past,
        ).payment_required

    signed = ask(client, x402_world, payment=sign_payment(offer(), x402_world.payers[0], None))
    Offering.objects.filter(pk=x402_world.offering.pk).update(stock=5)  # a written quote now
    written = ask(client, x402_world, payment=sign_payment(offer(), x402_world.payers[1], None))
    assert written.status_code == signed.status_code == 410, (written.content, signed.content)
    assert written.json()["code"] == signed.json()["code"] == "quote_expired"
    assert not Purchase.objects.exists() and x402_world.relayer_sent() == 0


@pytest.mark.django_db
def test_rotated_key_still_pays_a_402_signed_before_rotation_until_the_fallback_goes(
    client, x402_world, settings
):
    settings.X402_QUOTE_SIGNING_KEY = "old-key-" + "a" * 40
    old_402 = ask(client, x402_world)["PAYMENT-REQUIRED"]
    older_402 = ask(client, x402_world, OTHER)["PAYMENT-REQUIRED"]
    settings.X402_QUOTE_SIGNING_KEY = "new-key-" + "b" * 40
    settings.X402_QUOTE_SIGNING_KEY_FALLBACKS = ["old-key-" + "a" * 40]
    paid = ask(client, x402_world, payment=sign_payment(old_402, x402_world.payers[0], None))
    assert paid.status_code == 202, paid.content
    settings.X402_QUOTE_SIGNING_KEY_FALLBACKS = []
    refused = ask(
        client, x402_world, OTHER, payment=sign_payment(older_402, x402_world.payers[1], None)
    )
    assert refused.status_code == 400 and refused.json()["code"] == "quote_terms_invalid"


@pytest.mark.django_db
def test_a_second_payer_of_a_paid_signed_quote_is_refused_never_charged(client, x402_world):
    header = ask(client, x402_world)["PAYMENT-REQUIRED"]
    assert (
        ask(
            client, x402_world, payment=sign_payment(header, x402_world.payers[0], None)
        ).status_code
        == 202
    )
    second = ask(client, x402_world, payment=sign_payment(header, x402_world.payers[1], None))
    assert second.json()["code"] == "quote_already_paid"
    assert Purchase.objects.count() == 1 and x402_world.relayer_sent() == 1


PAYERS = 4


@pytest.mark.django_db(transaction=True)
def test_payers_racing_for_one_signed_quote_one_pays_none_charged_twice(
    x402_live_world, http_server
):
    """Every payer pays the same 402 at once: the quote's row is written once (the others
    find it written and are refused), no 5xx, one charge."""
    world = x402_live_world
    url = f"{http_server}{world.paid_url}"
    header = requests.post(url, json=INPUT, timeout=60).headers["PAYMENT-REQUIRED"]
    payers = [Account.create() for _ in range(PAYERS)]
    for payer in payers:
        mint(world.w3, world.token, world.deployer, payer.address, FUNDED)
    payments = [sign_payment(header, payer, None) for payer in payers]
    barrier = threading.Barrier(PAYERS)
    answers: list[tuple[int, str]] = [(0, "")] * PAYERS

    def pay(i: int) -> None:
        try:
            barrier.wait()
            answer = requests.post(
                url, json=INPUT, headers={"PAYMENT-SIGNATURE": payments[i]}, timeout=60
            )
            answers[i] = (answer.status_code, answer.json().get("code", ""))
        finally:
            connection.close()

    threads = [threading.Thread(target=pay, args=(i,)) for i in range(PAYERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    accepted = [a for a in answers if a[0] in (200, 202)]
    assert len(accepted) == 1, answers
    assert all(a == (402, "quote_already_paid") for a in answers if a not in accepted), answers
    assert Quote.objects.count() == 1 and Purchase.objects.count() == 1
    assert world.seller_balance() == PRICE
    charged = [p for p in payers if balance_of(world.w3, world.token, p.address) < FUNDED]
    assert len(charged) == 1
