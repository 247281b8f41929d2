"""What a buyer without an API key can reach: the capability status URL, GET and HEAD on the
paid URLs, discovery and CORS. On a real anvil chain."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient
from x402.http.utils import decode_payment_required_header, decode_payment_response_header
from x402.schemas import PaymentRequired

from core.canonical import canonical_json, sha256_hex
from fulfillment.models import Result
from payments.models import PaymentAttempt
from purchases.models import Purchase, Quote
from purchases.selectors import purchase_capability_url
from purchases.services.fulfil.execution import purchase_execute
from tests.x402.e2e import PRICE, sign_payment

pytestmark = pytest.mark.django_db
INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\n"}


@pytest.fixture
def client() -> APIClient:
    return APIClient()


def _buy(client, world, payer_index: int = 0, data=None):
    required = client.post(world.paid_url, data or INPUT, format="json")
    payment = sign_payment(required["PAYMENT-REQUIRED"], world.payers[payer_index], None)
    return client.post(world.paid_url, data or INPUT, format="json", HTTP_PAYMENT_SIGNATURE=payment)


def test_a_202_carries_a_capability_url_that_needs_no_key(client, x402_world):
    paid = _buy(client, x402_world)
    assert paid.status_code == 202
    status_url = paid["Location"]
    assert paid.json()["status_url"] == status_url
    assert paid.json()["next_action"] == "poll_status_url"
    ref = paid.json()["purchase"]
    assert status_url == purchase_capability_url(purchase=Purchase.objects.get(ref=ref))

    pending = APIClient().get(status_url)  # no key, no signature
    assert pending.status_code == 202 and pending.json()["purchase"] == ref
    assert pending["Retry-After"] and pending["Location"] == status_url

    purchase_execute(purchase_id=Purchase.objects.get(ref=ref).pk, worker="test")
    done = APIClient().get(status_url)
    assert done.status_code == 200 and done.json()["title"] == "Sales"
    assert decode_payment_response_header(done["PAYMENT-RESPONSE"]).success is True
    assert done["Link"].endswith('rel="receipt"')


def test_a_wrong_or_borrowed_token_is_404(client, x402_world):
    first = _buy(client, x402_world)
    second = _buy(client, x402_world, payer_index=1)
    first_ref = first.json()["purchase"]
    second_token = second["Location"].rstrip("/").rsplit("/", 1)[1]
    for url in (
        f"/x402/purchases/{first_ref}/{second_token}",  # another purchase's token
        f"/x402/purchases/{first_ref}/{'0' * 64}",
        f"/x402/purchases/pur_missing/{second_token}",
    ):
        response = APIClient().get(url)
        assert response.status_code == 404 and response.json()["code"] == "purchase_not_found"
        assert first_ref not in response.content.decode()


def test_the_capability_url_follows_result_retention(client, x402_world):
    paid = _buy(client, x402_world)
    purchase = Purchase.objects.get(ref=paid.json()["purchase"])
    purchase_execute(purchase_id=purchase.pk, worker="test")
    Result.objects.filter(purchase=purchase).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    expired = APIClient().get(paid["Location"])
    assert expired.status_code == 410 and expired.json()["code"] == "result_expired"
    assert expired.json()["receipt"].startswith("/api/v1/receipts/")


def test_unpaid_get_answers_the_same_402_and_a_query_input_gets_a_quote(client, x402_world):
    bare = client.get(x402_world.paid_url)
    assert bare.status_code == 402 and bare.json()["code"] == "payment_required"
    required = decode_payment_required_header(bare["PAYMENT-REQUIRED"])
    assert isinstance(required, PaymentRequired)
    (accept,) = required.accepts
    assert accept.amount == str(PRICE) and "quote" not in (accept.extra or {})
    assert bare.json()["input_schema"]["required"] == ["title", "csv"]
    assert not Quote.objects.exists()  # a price-only offer writes nothing

    query = {"title": "Sales", "csv": "a,b\nx,1\n"}
    quoted = client.get(x402_world.paid_url, query)
    assert quoted.status_code == 402
    quoted_required = decode_payment_required_header(quoted["PAYMENT-REQUIRED"])
    assert isinstance(quoted_required, PaymentRequired)
    extra = quoted_required.accepts[0].extra or {}
    # Anonymous and no stock: nothing written, the quote's terms travel signed in the 402.
    assert not Quote.objects.exists()
    assert extra["signedQuote"]["inputHash"] == sha256_hex(canonical_json(query))

    # Buying by GET, as a client retries it (the same URL, query string included): the
    # payment names the quote, whose input comes from the query and is written now.
    payment = sign_payment(quoted["PAYMENT-REQUIRED"], x402_world.payers[0], None)
    paid = client.get(x402_world.paid_url, query, HTTP_PAYMENT_SIGNATURE=payment)
    assert paid.status_code == 202 and paid.json()["payment"]["state"] == "paid"
    assert x402_world.seller_balance() == PRICE
    quote = Quote.objects.get(public_id=extra["quote"])
    assert quote.canonical_input == query and quote.state == Quote.State.ACCEPTED


def test_head_never_settles(client, x402_world):
    quoted = client.post(x402_world.paid_url, INPUT, format="json")
    payment = sign_payment(quoted["PAYMENT-REQUIRED"], x402_world.payers[0], None)
    response = client.head(x402_world.paid_url, HTTP_PAYMENT_SIGNATURE=payment)
    assert response.status_code == 402 and response["PAYMENT-REQUIRED"]
    assert response.content == b""
    assert x402_world.relayer_sent() == 0 and not PaymentAttempt.objects.exists()
    assert x402_world.seller_balance() == 0


def test_discovery_lists_every_paid_url_with_requirements_and_input(client, x402_world):
    response = client.get("/.well-known/x402")
    assert response.status_code == 200
    document = response.json()
    url = f"http://testserver{x402_world.paid_url}"
    assert document["version"] == 1 and url in document["resources"]
    (item,) = [i for i in document["items"] if i["resource"] == url]
    assert item["x402Version"] == 2 and item["type"] == "http"
    (accept,) = item["accepts"]
    assert (accept["amount"], accept["asset"]) == (str(PRICE), x402_world.token)
    assert accept["payTo"] == x402_world.seller.address
    assert item["metadata"]["inputSchema"]["required"] == ["title", "csv"]
    assert item["metadata"]["duplicateWindowSeconds"] == 600


def test_cors_on_paid_urls_exposes_the_payment_headers(client, x402_world):
    preflight = client.options(
        x402_world.paid_url,
        HTTP_ORIGIN="https://agent.example",
        HTTP_ACCESS_CONTROL_REQUEST_METHOD="POST",
        HTTP_ACCESS_CONTROL_REQUEST_HEADERS="payment-signature, content-type",
    )
    assert preflight.status_code == 200
    assert preflight["Access-Control-Allow-Origin"] == "*"
    assert "payment-signature" in preflight["Access-Control-Allow-Headers"]
    offer = client.post(x402_world.paid_url, INPUT, format="json", HTTP_ORIGIN="https://a.example")
    exposed = offer["Access-Control-Expose-Headers"]
    for header in ("PAYMENT-REQUIRED", "PAYMENT-RESPONSE", "Retry-After", "Location"):
        assert header in exposed
    # The API-key endpoints are not opened to other origins.
    other = client.get("/api/v1/offerings", HTTP_ORIGIN="https://a.example")
    assert "Access-Control-Allow-Origin" not in other
