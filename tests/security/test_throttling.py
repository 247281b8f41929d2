"""Paid URLs and quotes are rate limited per API key and per client address (issue 8, 9)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from rest_framework.test import APIClient

from config.settings import base
from tests.conftest import CSV_INPUT
from tests.factories import BuyerFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def fresh_counters(settings: Any) -> Any:
    """A cache namespace of this test's own (Redis in CI), so no other test's hits count."""
    settings.CACHES = {
        "default": {**settings.CACHES["default"], "KEY_PREFIX": f"throttle-{uuid.uuid4().hex}"}
    }
    return settings


def rates(settings: Any, **overrides: str) -> None:
    settings.TOLLBOOTH = {
        **settings.TOLLBOOTH,
        "THROTTLE_RATES": {**settings.TOLLBOOTH["THROTTLE_RATES"], **overrides},
    }


def assert_throttled(response: Any) -> None:
    assert response.status_code == 429, response.content
    body = response.json()
    assert (body["code"], body["retryable"]) == ("throttled", True)
    assert 1 <= int(response["Retry-After"]) <= 60
    assert response["Cache-Control"] == "no-store"


def test_a_burst_at_the_production_rates_gets_429_with_retry_after(fresh_counters, offering):
    production = base.TOLLBOOTH["THROTTLE_RATES"]
    rates(fresh_counters, **production)
    allowed = int(production["client_address"].split("/")[0])
    client = APIClient()
    statuses = []
    for n in range(allowed):
        # A client-chosen X-Forwarded-For is not an address: it must not reset the count.
        response = client.post(
            "/x402/no-such-offering", {}, format="json", HTTP_X_FORWARDED_FOR=f"10.0.0.{n}"
        )
        statuses.append(response.status_code)
    assert set(statuses) == {404}
    assert_throttled(client.post("/x402/no-such-offering", {}, format="json"))
    assert_throttled(client.post(f"/x402/{offering.slug}", CSV_INPUT, format="json"))


def test_each_api_key_has_its_own_limit_on_quotes(fresh_counters, offering, make_client, buyer):
    rates(fresh_counters, api_key="3/min")
    first, second = make_client(buyer), make_client(BuyerFactory.create())
    body = {"offering": offering.slug, "input": CSV_INPUT}
    assert [first.post("/api/v1/quotes", body, format="json").status_code for _ in range(3)] == [
        201,
        200,
        200,
    ]
    assert_throttled(first.post("/api/v1/quotes", body, format="json"))
    assert (
        first.post("/api/v1/quotes/qt_x/purchase", {"rail": "prepaid"}, format="json").status_code
        == 429
    )
    # Another key from the same address is not held back by the first key's burst.
    assert second.post("/api/v1/quotes", body, format="json").status_code == 201


def test_one_address_is_limited_across_keys(fresh_counters, offering, make_client, buyer):
    rates(fresh_counters, client_address="2/min")
    body = {"offering": offering.slug, "input": CSV_INPUT}
    assert make_client(buyer).post("/api/v1/quotes", body, format="json").status_code == 201
    other = make_client(BuyerFactory.create())
    assert other.post("/api/v1/quotes", body, format="json").status_code == 201
    assert_throttled(make_client(BuyerFactory.create()).post("/api/v1/quotes", body, format="json"))
    # Reads are not throttled by the paid-URL limits.
    assert other.get("/api/v1/offerings").status_code == 200
