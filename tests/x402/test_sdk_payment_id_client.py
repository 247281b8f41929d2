"""The official x402 Python client with the SDK's payment-identifier hook, against a live
server on anvil (docs/examples/x402_buy_with_payment_id.py, run as it is).

A call times out; the agent calls again with the same payment id, and the client signs a
new authorization under it. Before ids bound to the normalized request (x402 docs PR
#2307) that retry was `409 payment_identifier_conflict`, naming no purchase: a dead end. It
is the same request: answered with its purchase, and exactly one transfer ever lands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests

from payments.models import PaymentAttempt
from purchases.models import IdempotencyRecord, Offering, Purchase
from tests.integration.helpers import wait_for
from tests.x402.e2e import NETWORK, PRICE, X402World

ROOT = Path(__file__).resolve().parents[2]
CLIENT = [sys.executable, str(ROOT / "docs/examples/x402_buy_with_payment_id.py")]
INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\nsouth,5\n"}
PAYMENT_ID = "order-2026-12-01-000042"
pytestmark = [pytest.mark.postgres, pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def buy(url: str, world: X402World, *, timeout: float) -> dict[str, Any]:
    env = {
        **os.environ,
        "BUYER_KEY": "0x" + bytes(world.payers[0].key).hex(),
        "TOKEN": world.token,
        "NETWORK": NETWORK,
        "TIMEOUT": str(timeout),
        "PAYMENT_ID": PAYMENT_ID,
    }
    done = subprocess.run(
        [*CLIENT, url, json.dumps(INPUT)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout + 60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_timed_out_call_retried_with_the_same_id_is_answered_with_its_purchase(
    make_x402_world, settings, http_server, start_worker
):
    world = make_x402_world(no_mining=True)
    # Only the id protects this buyer: no duplicate window to fall back on.
    Offering.objects.update(duplicate_window=timedelta(0))
    settings.X402_RESULT_WAIT_SECONDS = 30
    settings.X402_NETWORKS = {
        **settings.X402_NETWORKS,
        NETWORK: {**world.network_settings, "confirmation_timeout": 6.0},
    }
    start_worker("w1")
    url = f"{http_server}{world.paid_url}"
    assert buy(url, world, timeout=2)["outcome"] == "timeout"
    attempt = wait_for(
        lambda: PaymentAttempt.objects.filter(state="settlement_pending").first(),
        message="the abandoned request to record its pending broadcast",
    )
    record = IdempotencyRecord.objects.get()
    assert record.key == PAYMENT_ID  # the hook sent the id

    retry = buy(url, world, timeout=60)  # same id, a new 402, a new signature

    assert retry["outcome"] == "response" and retry["status"] == 202, retry
    purchase = Purchase.objects.get()
    body = json.loads(retry["body"])
    assert body["purchase"] == purchase.ref and body["transaction"] == attempt.tx_hash
    assert retry["headers"]["location"] == body["status_url"]
    assert world.relayer_sent() == 1
    world.node.mine()  # the one broadcast lands
    result = wait_for(
        lambda: _ready(requests.get(f"{http_server}{body['status_url']}", timeout=30)),
        timeout=60,
        interval=0.5,
        message="the result at the capability URL",
    )
    assert result.json()["title"] == "Sales"
    # Never charged again: one purchase, one attempt, one broadcast, one transfer.
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1
    assert Purchase.objects.count() == 1 and PaymentAttempt.objects.count() == 1
    assert IdempotencyRecord.objects.count() == 1


def _ready(response: requests.Response) -> requests.Response | None:
    assert response.status_code in (200, 202), response.text
    return response if response.status_code == 200 else None
