"""Schemathesis against /api/schema/ through the WSGI app: every check, every operation.

Hostile input must get a documented 4xx, never a 5xx, and every answer must match the
schema (status, content type, headers, body). A buyer with a funded key, an offering, an
open quote and a delivered purchase exist, so keyed operations reach their real paths.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core import signals
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from config.wsgi import application
from purchases.services.shared.buyers import api_key_issue
from tests.factories import BuyerFactory, OfferingFactory, fund

EXAMPLES_PER_OPERATION = 200

# NUL is outside the API's text (refused with 400 invalid_text, docs/security.md), so valid
# data never holds it. A paid URL answers a schema-valid request whose PAYMENT-SIGNATURE is
# not a signed payload with 400, and one without it with 402: both are its contract.
# A callback URL that the schema allows can still name an address no webhook may reach (a
# private one, or one not resolving): 400 callback_url_invalid is its contract too.
CONFIG = SchemathesisConfig.from_str(
    """
[generation]
allow-x00 = false

[[operations]]
include-path = "/x402/{offering}"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "402", "404", "409", "429"]

[[operations]]
include-path = "/api/v1/webhook-callback"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "404", "429"]
"""
)
schema = schemathesis.openapi.from_wsgi("/api/schema/", application, config=CONFIG)


@pytest.fixture
def api_key(db: None) -> Iterator[str]:
    # As Django's test client does: the WSGI app must not close the test's connection.
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    buyer = BuyerFactory.create()
    fund(buyer, 10_000_000)
    OfferingFactory.create(slug="csv-report")
    try:
        yield api_key_issue(buyer=buyer)
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_api_conforms_to_its_schema(case: Any, api_key: str) -> None:
    case.call_and_validate(headers={"Authorization": f"Bearer {api_key}"})
