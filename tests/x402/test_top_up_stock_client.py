"""Top-ups bought by the official x402 Python client as it ships (docs/examples/x402_top_up.py),
against a live server, a real worker and anvil: the balance, read back through
GET /api/v1/balance, rises by exactly the amount, once, even when the caller gave up before
the answer and called again (the client re-signs: a new nonce)."""

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

from fulfillment.receipt_signing import receipt_verify, signing_key
from payments.models import LedgerEntry, PaymentAttempt
from purchases.models import Purchase
from purchases.services.shared.buyers import api_key_issue
from tests.factories import BuyerFactory
from tests.integration.helpers import wait_for
from tests.x402.e2e import NETWORK, MakeWorld, X402World

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "docs/examples/x402_top_up.py"
AMOUNT = 2_500_000  # 2.50: above the client's default cap, as real top-ups are
pytestmark = [pytest.mark.postgres, pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def top_up(url: str, world: X402World, api_key: str, *, timeout: float) -> dict[str, Any]:
    env = {
        **os.environ,
        "API_KEY": api_key,
        "BUYER_KEY": "0x" + bytes(world.payers[0].key).hex(),
        "TOKEN": world.token,
        "NETWORK": NETWORK,
        "TIMEOUT": str(timeout),
    }
    done = subprocess.run(
        [sys.executable, str(CLIENT), url],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout + 60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def balance(base: str, api_key: str, asset: str) -> int:
    """The buyer's balance in `asset`, as the buyer reads it (GET /api/v1/balance)."""
    response = requests.get(
        f"{base}/api/v1/balance", headers={"Authorization": f"Bearer {api_key}"}, timeout=30
    )
    assert response.status_code == 200, response.text
    rows = {row["asset"]: int(row["amount"]) for row in response.json()["balances"]}
    return rows.get(asset, 0)


def top_up_world(make_x402_world: MakeWorld, settings: Any, **options: Any) -> X402World:
    world = make_x402_world(offering={"slug": "top-up", "top_up": True}, **options)
    settings.X402_RESULT_WAIT_SECONDS = 30  # after the world's own (0): answer with the credit
    return world


def test_stock_client_tops_up_once_and_gets_the_balance_and_a_receipt(
    make_x402_world, settings, http_server, start_worker
):
    world = top_up_world(make_x402_world, settings)
    start_worker("w1")
    key = api_key_issue(buyer=BuyerFactory.create())
    url = f"{http_server}{world.paid_url}?amount={AMOUNT}"
    got = top_up(url, world, key, timeout=60)
    assert got["outcome"] == "response" and got["status"] == 200, got
    purchase = Purchase.objects.get()
    body = json.loads(got["body"])["top_up"]
    assert (body["purchase"], body["credited"], body["balance"]) == (
        purchase.ref,
        str(AMOUNT),
        str(AMOUNT),
    )
    settle = decode_payment_response_header(got["headers"]["payment-response"])
    attempt = PaymentAttempt.objects.get()
    assert settle.success is True and settle.transaction == attempt.tx_hash
    receipt = json.loads(base64.b64decode(got["headers"]["tollbooth-receipt"]))
    receipt_verify(receipt, addresses=[signing_key().address])
    payload = receipt["payload"]
    assert (payload["amount"], payload["purchase"]) == (str(AMOUNT), purchase.ref)
    assert payload["resultSha256"] == hashlib.sha256(got["body"].encode()).hexdigest()
    assert balance(http_server, key, world.token) == AMOUNT
    assert world.seller_balance() == AMOUNT and world.relayer_sent() == 1
    assert LedgerEntry.objects.filter(kind=LedgerEntry.Kind.TOP_UP).count() == 1


def test_aborted_connection_then_re_signed_retry_credits_once(
    make_x402_world, settings, http_server, start_worker
):
    world = top_up_world(make_x402_world, settings, no_mining=True)
    # The server waits 6 s for a block that never comes; the caller gives up after 2 s.
    settings.X402_NETWORKS = {
        **settings.X402_NETWORKS,
        NETWORK: {**world.network_settings, "confirmation_timeout": 6.0},
    }
    start_worker("w1")
    key = api_key_issue(buyer=BuyerFactory.create())
    url = f"{http_server}{world.paid_url}?amount={AMOUNT}"
    assert top_up(url, world, key, timeout=2)["outcome"] == "timeout"
    attempt = wait_for(
        lambda: PaymentAttempt.objects.filter(state="settlement_pending").first(),
        message="the abandoned request to record its pending broadcast",
    )
    # Pending is not credited, and not failed.
    assert balance(http_server, key, world.token) == 0

    retry = top_up(url, world, key, timeout=60)  # the SDK re-signs: a new nonce, a new 402
    assert retry["outcome"] == "response" and retry["status"] == 202, retry
    purchase = Purchase.objects.get()
    assert retry["headers"]["tollbooth-duplicate-of"] == purchase.ref
    assert json.loads(retry["body"])["transaction"] == attempt.tx_hash
    assert balance(http_server, key, world.token) == 0

    world.node.mine()  # the one broadcast lands
    # The agent polls the status URL its 202 named (in production the reconciliation beat
    # finds the landed transfer too): the settlement is confirmed, the worker credits it.
    status_url = f"{http_server}{retry['headers']['location']}"
    status = wait_for(
        lambda: _ready(requests.get(status_url, timeout=30)),
        timeout=60,
        interval=0.5,
        message="the credit at the status URL",
    )
    assert status.json()["top_up"] == {
        "purchase": purchase.ref,
        "credited": str(AMOUNT),
        "asset": world.token,
        "ledger_reference": f"top_up:{purchase.ref}",
        "balance": str(AMOUNT),
    }
    assert balance(http_server, key, world.token) == AMOUNT
    assert world.seller_balance() == AMOUNT and world.relayer_sent() == 1
    assert Purchase.objects.count() == 1 and PaymentAttempt.objects.count() == 1
    assert LedgerEntry.objects.filter(kind=LedgerEntry.Kind.TOP_UP).count() == 1


def _ready(response: requests.Response) -> requests.Response | None:
    assert response.status_code in (200, 202), response.text
    return response if response.status_code == 200 else None
