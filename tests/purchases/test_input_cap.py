"""Every quote's input is capped per offering: anonymous 402s cannot park megabytes each."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from purchases.models import Offering, PurchaseEvent, Quote
from tests.conftest import CSV_INPUT
from tests.factories import OfferingFactory

pytestmark = pytest.mark.django_db
HUGE = {"title": "Sales", "csv": "region,units\n" + "north,3\n" * 40_000}  # ~320 KB


def assert_refused_too_large(response, *, limit: int) -> None:
    assert response.status_code == 413, response.content
    assert response["Content-Type"].startswith("application/problem+json")
    body = response.json()
    assert (body["code"], body["retryable"], body["next_action"]) == (
        "input_too_large",
        False,
        "shrink_input",
    )
    assert body["max_input_bytes"] == limit
    assert body["input_bytes"] > limit
    assert not Quote.objects.exists()
    assert not PurchaseEvent.objects.exists()


def test_offerings_cap_input_at_64_kib_by_default(offering):
    assert offering.max_input_bytes == Offering._meta.get_field("max_input_bytes").default
    assert offering.max_input_bytes == 64 * 1024


def test_keyed_quote_over_the_cap_is_413_and_stores_nothing(client_for_buyer, offering):
    response = client_for_buyer.post(
        "/api/v1/quotes", {"offering": offering.slug, "input": HUGE}, format="json"
    )
    assert_refused_too_large(response, limit=64 * 1024)


def test_anonymous_x402_request_over_the_cap_is_413_and_stores_nothing(offering):
    response = APIClient().post(f"/x402/{offering.slug}", HUGE, format="json")
    assert_refused_too_large(response, limit=64 * 1024)


def test_the_cap_is_per_offering_and_counts_canonical_json_bytes(client_for_buyer):
    small = OfferingFactory.create(max_input_bytes=100)
    fits = {"title": "é", "csv": "a\n1\n"}  # canonical JSON, é counted as its 2 UTF-8 bytes
    fits_bytes = len('{"csv":"a\\n1\\n","title":"é"}'.encode())
    padded = {**fits, "csv": "a\n1\n" + "x" * (100 - fits_bytes)}
    over = {**padded, "csv": padded["csv"] + "x"}

    def post(data):
        return client_for_buyer.post(
            "/api/v1/quotes", {"offering": small.slug, "input": data}, format="json"
        )

    assert post(padded).status_code == 201
    response = post(over)
    assert response.status_code == 413
    assert response.json()["input_bytes"] == 101
    assert Quote.objects.count() == 1
    assert post(CSV_INPUT).status_code == 201  # an ordinary input is unaffected
