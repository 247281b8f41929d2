"""The authorization flow bought with the stock Python x402 client, unmodified, on a seller's
signed HTTP upstream (a real process) run by a real worker, paid on anvil.

A call the upstream rejects (a declared 422, answered before any effect) leaves the buyer's
wallet untouched: verified and held, never settled, and the buyer is told so. A call it
accepts is charged once, and its result comes back only once that charge is confirmed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from x402.http.utils import decode_payment_response_header

from fulfillment.models import Upstream
from payments.chain.token import balance_of
from payments.models import PaymentAttempt, Refund
from purchases.models import Purchase, PurchaseEvent
from tests.fixtures.sample_upstream import SECRET_ENV, SampleUpstream
from tests.x402.e2e import FUNDED, NETWORK, PRICE, X402World

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.postgres, pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def buy(url: str, world: X402World, body: dict[str, Any]) -> dict[str, Any]:
    """One call of the stock Python client (docs/examples/x402_buy.py) in its own process."""
    env = {
        **os.environ,
        "BUYER_KEY": "0x" + bytes(world.payers[0].key).hex(),
        "TOKEN": world.token,
        "NETWORK": NETWORK,
        "TIMEOUT": "60",
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs/examples/x402_buy.py"), url, json.dumps(body)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def world(make_x402_world, sample_upstream: SampleUpstream, settings) -> X402World:
    world = make_x402_world(
        offering={
            "delivery_condition": "authorization",
            "executor": "http",
            "input_schema": {"type": "object"},
            "volatile_fields": [],
        }
    )
    Upstream.objects.create(
        offering=world.offering,
        kind="http",
        url=sample_upstream.url + "/work",
        secret_env=SECRET_ENV,
        timeout_seconds=2,
        definitive_statuses=[422],
        max_result_bytes=4096,
    )
    settings.X402_RESULT_WAIT_SECONDS = 30
    return world


def _payer_balance(world: X402World) -> int:
    return balance_of(world.w3, world.token, world.payers[0].address)


def test_a_rejected_call_leaves_the_buyers_wallet_untouched(
    world, sample_upstream, http_server, start_worker
):
    start_worker("w1", extra_env=world.worker_env())
    got = buy(f"{http_server}{world.paid_url}", world, {"q": "nope", "reject": 422})
    assert got["outcome"] == "response" and got["status"] == 409, got
    body = json.loads(got["body"])
    assert body["code"] == "execution_failed" and body["charged"] is False
    attempt = PaymentAttempt.objects.get()
    assert body["authorization_lapses_at"] == attempt.valid_before_at.isoformat()
    assert "We will not charge this authorization" in body["detail"]
    purchase = Purchase.objects.get()
    assert (purchase.payment_state, purchase.fulfillment_state) == ("released", "failed")
    assert (attempt.state, attempt.reason_code) == ("failed", "authorization_released")
    assert attempt.broadcast_started_at is None and attempt.tx_hash is None
    # On chain: nothing moved, nothing was sent.
    assert _payer_balance(world) == FUNDED and world.seller_balance() == 0
    assert world.relayer_sent() == 0
    assert not Refund.objects.exists()  # nothing was taken, so nothing is owed
    assert sample_upstream.stats()["effects"] == 0


def test_an_accepted_call_is_charged_once_and_released_after_its_settlement(
    world, sample_upstream, http_server, start_worker
):
    start_worker("w1", extra_env=world.worker_env())
    got = buy(f"{http_server}{world.paid_url}", world, {"q": "fine"})
    assert got["outcome"] == "response" and got["status"] == 200, got
    purchase = Purchase.objects.get()
    assert json.loads(got["body"])["key"] == f"tollbooth-{purchase.ref}"
    attempt = PaymentAttempt.objects.get()
    settle = decode_payment_response_header(got["headers"]["payment-response"])
    assert settle.success is True and settle.transaction == attempt.tx_hash
    assert _payer_balance(world) == FUNDED - PRICE and world.seller_balance() == PRICE
    assert world.relayer_sent() == 1 and sample_upstream.stats()["effects"] == 1
    events = list(PurchaseEvent.objects.filter(purchase=purchase).order_by("created_at", "pk"))
    paid = next(i for i, e in enumerate(events) if e.to_state == "paid")
    delivered = next(i for i, e in enumerate(events) if e.subject == "result.delivered")
    stored = next(i for i, e in enumerate(events) if e.reason_code == "work_succeeded")
    assert stored < paid < delivered
