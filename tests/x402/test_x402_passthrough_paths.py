"""A path below a pass-through offering's URL that would leave its prefix is refused with a
clear 400 before anything is quoted, and a body over the offering's bound with a 413. Sent
raw (http.client: no client-side normalising) to the ASGI app under uvicorn, the shape that
serves /x402 in production, whose raw request target shows encoded slashes."""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit

import pytest

from fulfillment.models import Upstream
from purchases.models import Quote
from tests.factories import OfferingFactory

pytestmark = [pytest.mark.django_db(transaction=True)]


def send(base: str, method: str, target: str, body: bytes = b"") -> tuple[int, dict[str, Any]]:
    parts = urlsplit(base)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    try:
        headers = {"Content-Type": "application/json"} if body else {}
        connection.request(method, target, body=body or None, headers=headers)
        response = connection.getresponse()
        raw = response.read()
        return response.status, json.loads(raw) if raw else {}
    finally:
        connection.close()


@pytest.fixture
def passing_slug() -> str:
    offering = OfferingFactory.create(
        executor="http", input_schema={"type": "object"}, volatile_fields=[], max_input_bytes=2048
    )
    Upstream.objects.create(
        offering=offering,
        kind="http",
        url="https://api.seller.example/v1",
        input_mode="request",
        secret_env="SELLER_SECRET",
    )
    return offering.slug


ESCAPES = [
    "../admin",
    "a/../../etc/passwd",
    "a/%2e%2e/%2E%2E/etc",
    "a%2Fb",
    "a%2fb/c",
    "a%5c..%5cb",
    "a/%252e%252e/b",
    "/etc/passwd",
    "a//b",
    "http://evil.example/x",
    "http:evil.example",
    "a/./b",
]


def test_a_path_that_escapes_the_prefix_is_a_400_and_nothing_is_quoted(
    asgi_server: str, passing_slug: str
) -> None:
    for rest in ESCAPES:
        status, problem = send(asgi_server, "GET", f"/x402/{passing_slug}/{rest}?q=1")
        assert (rest, status, problem["code"]) == (rest, 400, "invalid_request"), problem
    assert not Quote.objects.exists()


def test_a_path_inside_the_prefix_is_offered(asgi_server: str, passing_slug: str) -> None:
    status, _ = send(asgi_server, "GET", f"/x402/{passing_slug}/items/7:batch?q=1")
    assert status == 402


def test_a_body_over_the_offerings_bound_is_a_413(asgi_server: str, passing_slug: str) -> None:
    status, problem = send(asgi_server, "POST", f"/x402/{passing_slug}/orders", b"x" * 4096)
    assert (status, problem["code"]) == (413, "input_too_large")
    assert not Quote.objects.exists()


def test_an_offering_that_passes_no_path_through_has_none_below_it(asgi_server: str) -> None:
    offering = OfferingFactory.create()
    status, problem = send(asgi_server, "GET", f"/x402/{offering.slug}/items/7")
    assert (status, problem["code"]) == (404, "offering_not_found")


def test_the_offerings_own_url_refuses_an_input_that_is_not_a_passed_request(
    asgi_server: str, passing_slug: str
) -> None:
    # Quoted and paid, the worker would refuse it after the payment: refused before the quote.
    status, problem = send(asgi_server, "POST", f"/x402/{passing_slug}", b'{"q": "x"}')
    assert (status, problem["code"]) == (422, "invalid_input")
    assert f"/x402/{passing_slug}/<path>" in problem["detail"]
    assert not Quote.objects.exists()


def test_discovery_names_the_prefix_and_its_methods(asgi_server: str, passing_slug: str) -> None:
    status, document = send(asgi_server, "GET", "/.well-known/x402")
    assert status == 200
    item = next(i for i in document["items"] if i["resource"].endswith(f"/x402/{passing_slug}"))
    assert item["metadata"]["passesRequest"] == {
        "pathPrefix": f"{asgi_server}/x402/{passing_slug}/",
        "methods": ["GET", "POST", "PUT", "PATCH", "DELETE"],
    }
    assert "get" not in item["metadata"]
