"""The official x402 clients, as they ship, buy from a live server on anvil.

The Python SDK (`x402`, requests wrapper) and the TypeScript `@x402/fetch` + `@x402/evm` +
viem, pinned, each run as their own process from the examples in docs/examples/ (the same
files docs/x402.md shows). Nothing is added to them: no payment-id hook, no polling. When
a call times out, the test calls again exactly as an agent would, and the client re-signs a
fresh authorization: exactly one transfer ever lands, and the caller gets the result.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests
from x402.http.utils import decode_payment_response_header

from fulfillment.receipt_signing import receipt_verify
from payments.models import PaymentAttempt
from purchases.models import IdempotencyRecord, Purchase, PurchaseEvent
from tests.integration.helpers import wait_for
from tests.x402.e2e import NETWORK, PRICE, X402World

ROOT = Path(__file__).resolve().parents[2]
INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\nsouth,5\n"}
CLIENTS = {
    "python": [sys.executable, str(ROOT / "docs/examples/x402_buy.py")],
    "typescript": ["node", str(ROOT / "docs/examples/x402-buy.mjs")],
}
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.worker,
    pytest.mark.django_db(transaction=True),
    pytest.mark.parametrize("kind", sorted(CLIENTS)),
]


def buy(kind: str, url: str, world: X402World, *, timeout: float) -> dict[str, Any]:
    """One call of the stock client, in its own process: what its caller gets back."""
    payer = world.payers[0]
    env = {
        **os.environ,
        "BUYER_KEY": "0x" + bytes(payer.key).hex(),
        "TOKEN": world.token,
        "NETWORK": NETWORK,
        "TIMEOUT": str(timeout),
    }
    done = subprocess.run(
        [*CLIENTS[kind], url, json.dumps(INPUT)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout + 60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_stock_client_buys_in_one_round_trip(
    make_x402_world, kind, settings, http_server, start_worker
):
    world = make_x402_world()
    settings.X402_RESULT_WAIT_SECONDS = 30
    start_worker("w1")
    got = buy(kind, f"{http_server}{world.paid_url}", world, timeout=60)
    assert got["outcome"] == "response" and got["status"] == 200, got
    assert json.loads(got["body"])["title"] == "Sales"
    settle = decode_payment_response_header(got["headers"]["payment-response"])
    attempt = PaymentAttempt.objects.get()
    assert settle.success is True and settle.transaction == attempt.tx_hash
    # No payment id was sent: the payment is keyed by its authorization.
    assert IdempotencyRecord.objects.get().key.startswith("auth:")
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1


def test_timed_out_call_retried_pays_once_and_ends_with_the_result(
    make_x402_world, kind, settings, http_server, start_worker
):
    world = make_x402_world(no_mining=True)
    node = world.node
    settings.X402_RESULT_WAIT_SECONDS = 30
    # The server waits 6 s for a block that never comes; the caller gives up after 2 s.
    settings.X402_NETWORKS = {
        **settings.X402_NETWORKS,
        NETWORK: {**world.network_settings, "confirmation_timeout": 6.0},
    }
    start_worker("w1")
    url = f"{http_server}{world.paid_url}"
    assert buy(kind, url, world, timeout=2)["outcome"] == "timeout"
    attempt = wait_for(
        lambda: PaymentAttempt.objects.filter(state="settlement_pending").first(),
        message="the abandoned request to record its pending broadcast",
    )

    retry = buy(kind, url, world, timeout=60)  # the SDK re-signs: a new nonce, a new 402
    assert retry["outcome"] == "response" and retry["status"] == 202, retry
    purchase = Purchase.objects.get()
    assert retry["headers"]["tollbooth-duplicate-of"] == purchase.ref
    body = json.loads(retry["body"])
    assert body["purchase"] == purchase.ref and body["transaction"] == attempt.tx_hash
    status_url = retry["headers"]["location"]
    assert body["status_url"] == status_url and world.relayer_sent() == 1

    node.mine()  # the one broadcast lands
    result = wait_for(
        lambda: _ready(requests.get(f"{http_server}{status_url}", timeout=30)),
        timeout=60,
        interval=0.5,
        message="the result at the capability URL",
    )
    assert result.json()["title"] == "Sales"
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1
    assert Purchase.objects.count() == 1 and PaymentAttempt.objects.count() == 1
    assert PurchaseEvent.objects.filter(subject="purchase.duplicate").count() == 1


def _ready(response: requests.Response) -> requests.Response | None:
    assert response.status_code in (200, 202), response.text
    return response if response.status_code == 200 else None


def test_stock_client_gets_a_signed_receipt_on_a_paid_call(
    make_x402_world, kind, settings, http_server, start_worker
):
    """Confirmed at its finality depth, the settlement is final as the call is answered: the
    stock client's 200 carries the signed receipt, which verifies against the published key
    and names the transaction, the block's time and the SHA-256 of the body it got."""
    world = make_x402_world()
    settings.X402_RESULT_WAIT_SECONDS = 30
    start_worker("w1")
    got = buy(kind, f"{http_server}{world.paid_url}", world, timeout=60)
    assert got["outcome"] == "response" and got["status"] == 200, got

    receipt = json.loads(base64.b64decode(got["headers"]["tollbooth-receipt"]))
    keys = requests.get(f"{http_server}/.well-known/tollbooth-receipts", timeout=30).json()
    receipt_verify(receipt, addresses=[key["address"] for key in keys["keys"]])
    attempt = PaymentAttempt.objects.get()
    block = world.w3.eth.get_block(attempt.block_number)
    payload = receipt["payload"]
    assert (payload["transaction"], payload["settledAt"]) == (attempt.tx_hash, block["timestamp"])
    assert payload["resultSha256"] == hashlib.sha256(got["body"].encode()).hexdigest()
    assert (payload["amount"], payload["purchase"]) == (str(PRICE), Purchase.objects.get().ref)
