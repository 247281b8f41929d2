from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from purchases.models import Offering, PurchaseEvent, Quote
from purchases.services.quote.quotes import quote_create
from tests.conftest import CSV_INPUT
from tests.factories import OfferingFactory

# Also run on the embedded SQLite default (`make test`'s second pass): `make demo` serves this.
pytestmark = [pytest.mark.django_db, pytest.mark.embedded]


def post_quote(client: APIClient, offering: str, data: dict) -> tuple[int, dict]:
    response = client.post("/api/v1/quotes", {"offering": offering, "input": data}, format="json")
    return response.status_code, response.json()


def test_new_quote_is_201_with_price_version_expiry(client_for_buyer, offering):
    before = timezone.now()
    status, body = post_quote(client_for_buyer, offering.slug, CSV_INPUT)
    assert status == 201
    assert body["price"] == "250000"
    assert body["version"] == 1
    assert body["state"] == "open"
    expires_at = Quote.objects.get(public_id=body["id"]).expires_at
    assert before + timedelta(minutes=15) <= expires_at <= timezone.now() + timedelta(minutes=15)
    assert body["links"]["purchase"] == f"/api/v1/quotes/{body['id']}/purchase"


def test_same_canonical_input_while_open_returns_the_same_quote(client_for_buyer, offering):
    _, first = post_quote(client_for_buyer, offering.slug, {**CSV_INPUT, "request_id": "a"})
    reordered = {"csv": CSV_INPUT["csv"], "title": CSV_INPUT["title"], "request_id": "b"}
    status, second = post_quote(client_for_buyer, offering.slug, reordered)
    assert status == 200
    assert second["id"] == first["id"]
    assert Quote.objects.count() == 1


def test_different_input_or_buyer_gets_a_new_quote(client_for_buyer, offering, make_client):
    _, first = post_quote(client_for_buyer, offering.slug, CSV_INPUT)
    status, other_input = post_quote(
        client_for_buyer, offering.slug, {**CSV_INPUT, "title": "Other"}
    )
    assert status == 201 and other_input["id"] != first["id"]
    from tests.factories import BuyerFactory

    status, other_buyer = post_quote(make_client(BuyerFactory.create()), offering.slug, CSV_INPUT)
    assert status == 201 and other_buyer["id"] != first["id"]


def test_expired_open_quote_is_replaced_and_its_stock_released(buyer, offering):
    offering.stock = 1
    offering.save()
    first = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=CSV_INPUT)
    assert Offering.objects.get(pk=offering.pk).stock == 0
    later = timezone.now() + timedelta(minutes=16)
    second = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=CSV_INPUT, now=later)
    assert second.created and second.quote.pk != first.quote.pk
    first.quote.refresh_from_db()
    assert first.quote.state == Quote.State.EXPIRED
    assert Offering.objects.get(pk=offering.pk).stock == 0  # released, then held by the new quote
    assert PurchaseEvent.objects.filter(quote=first.quote, reason_code="quote_expired").count() == 1


def test_sold_out(client_for_buyer):
    offering = OfferingFactory.create(stock=1)
    assert post_quote(client_for_buyer, offering.slug, CSV_INPUT)[0] == 201
    status, body = post_quote(client_for_buyer, offering.slug, {**CSV_INPUT, "title": "again"})
    assert status == 409
    assert body["code"] == "sold_out"
    assert Offering.objects.get(pk=offering.pk).stock == 0
    assert Quote.objects.filter(offering=offering).count() == 1


def test_unknown_offering(client_for_buyer):
    status, body = post_quote(client_for_buyer, "no-such-thing", CSV_INPUT)
    assert status == 404
    assert body["code"] == "offering_not_found"


def test_invalid_input_lists_schema_errors(client_for_buyer, offering):
    response = client_for_buyer.post(
        "/api/v1/quotes", {"offering": offering.slug, "input": {"title": 3}}, format="json"
    )
    assert response.status_code == 422
    assert response["Content-Type"] == "application/problem+json"
    body = response.json()
    assert body["code"] == "invalid_input"
    assert body["owner"] == "buyer"
    assert body["retryable"] is False
    messages = " ".join(e["message"] for e in body["errors"])
    assert "'csv' is a required property" in messages
    assert Quote.objects.count() == 0


def test_missing_body_fields_are_invalid_request(client_for_buyer):
    response = client_for_buyer.post("/api/v1/quotes", {}, format="json")
    assert response.status_code == 400
    assert response.json()["code"] == "invalid_request"


def test_api_requires_a_valid_key(offering):
    anonymous = APIClient()
    response = anonymous.post(
        "/api/v1/quotes", {"offering": offering.slug, "input": CSV_INPUT}, format="json"
    )
    assert response.status_code == 401
    assert response.json()["code"] == "not_authenticated"
    anonymous.credentials(HTTP_AUTHORIZATION="Bearer tbk_nothere_secret")
    assert anonymous.get("/api/v1/offerings").status_code == 401
