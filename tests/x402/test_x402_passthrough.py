"""An existing API sold as it is (issue 35, part 2): an offering whose http upstream passes
the request through covers a path prefix. The stock x402 Python client pays for
`/x402/<offering>/<rest>` on a live server and anvil; the sample upstream (a real process)
sees the request's method, path, query and body unchanged, signed, once per purchase."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import requests
from eth_account import Account
from x402 import x402ClientSync
from x402.http.clients.requests import wrapRequestsWithPayment
from x402.mechanisms.evm.exact import ExactEvmClientScheme

from fulfillment.models import Upstream
from purchases.models import Purchase, PurchaseEvent, Quote
from tests.fixtures.sample_upstream import SECRET_ENV, SampleUpstream
from tests.x402.e2e import NETWORK, PRICE, MakeWorld, X402World

pytestmark = [pytest.mark.postgres, pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def passing_world(make_world: MakeWorld, upstream: SampleUpstream, settings: Any) -> X402World:
    world = make_world(
        offering={"executor": "http", "input_schema": {"type": "object"}, "volatile_fields": []}
    )
    Upstream.objects.create(
        offering=world.offering,
        kind="http",
        url=upstream.url + "/api",
        input_mode="request",
        secret_env=SECRET_ENV,
        timeout_seconds=2,
        max_result_bytes=4096,
    )
    settings.X402_RESULT_WAIT_SECONDS = 30
    return world


def paying_session(world: X402World) -> requests.Session:
    """The stock client, as docs/examples/x402_buy.py sets it up."""
    client = x402ClientSync()
    client.register(NETWORK, ExactEvmClientScheme(signer=Account.from_key(world.payers[0].key)))
    client.set_spend_controls({"allowed_assets": [{"network": NETWORK, "asset": world.token}]})
    return wrapRequestsWithPayment(requests.Session(), client)


def seen_by_upstream(response: requests.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    seen: dict[str, Any] = response.json()["input"]
    return seen


def test_a_paid_get_and_post_reach_the_upstream_unchanged_once_each(
    make_x402_world, sample_upstream, settings, http_server, start_worker
):
    world = passing_world(make_x402_world, sample_upstream, settings)
    start_worker("w1")
    session = paying_session(world)
    base = f"{http_server}{world.paid_url}"

    got = session.get(f"{base}/items/7?b=2&a=1&tag=x%20y", timeout=60)
    assert seen_by_upstream(got) == {
        "method": "GET",
        "target": "/api/items/7?b=2&a=1&tag=x%20y",
        "content_type": "",
        "body": "",
    }
    body = b'{"name": "widget", "qty": 3}'
    posted = session.post(
        f"{base}/orders?dry=0", data=body, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert seen_by_upstream(posted) == {
        "method": "POST",
        "target": "/api/orders?dry=0",
        "content_type": "application/json",
        "body": body.decode(),
    }

    purchases = list(Purchase.objects.order_by("pk"))
    assert len(purchases) == 2
    assert sample_upstream.stats()["effects"] == 2
    assert world.seller_balance() == 2 * PRICE and world.relayer_sent() == 2
    # The request itself is the input: the quote, the duplicate window and the timeline.
    inputs = [Quote.objects.get(pk=p.quote_id).canonical_input for p in purchases]
    assert [(i["method"], i["path"], i["query"]) for i in inputs] == [
        ("GET", "/items/7", "b=2&a=1&tag=x%20y"),
        ("POST", "/orders", "dry=0"),
    ]
    assert inputs[1]["body_sha256"] == hashlib.sha256(body).hexdigest()


def test_a_retry_of_the_same_request_is_the_existing_purchase_and_another_path_a_new_one(
    make_x402_world, sample_upstream, settings, http_server, start_worker
):
    world = passing_world(make_x402_world, sample_upstream, settings)
    start_worker("w1")
    session = paying_session(world)
    url = f"{http_server}{world.paid_url}/reports/q3?format=csv"

    first = session.post(url, json={"region": "north"}, timeout=60)
    again = session.post(url, json={"region": "north"}, timeout=60)  # re-signed by the client
    assert seen_by_upstream(first) == seen_by_upstream(again)
    purchase = Purchase.objects.get()
    assert again.headers["Tollbooth-Duplicate-Of"] == purchase.ref
    assert PurchaseEvent.objects.filter(subject="purchase.duplicate").count() == 1
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1
    assert sample_upstream.stats()["effects"] == 1

    other = session.post(f"{http_server}{world.paid_url}/reports/q4?format=csv", json={})
    assert json.loads(other.text)["input"]["target"] == "/api/reports/q4?format=csv"
    assert Purchase.objects.count() == 2 and sample_upstream.stats()["effects"] == 2
    assert world.seller_balance() == 2 * PRICE
