"""The top-up tool over MCP: the official `x402.mcp` client, unchanged, with the API key on the
connection (whose balance it credits), against the ASGI app on a live server, a real worker
and anvil. The balance is read back through GET /api/v1/balance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests

from fulfillment.receipt_signing import receipt_verify, signing_key
from payments.models import LedgerEntry, PaymentAttempt
from purchases.models import Purchase
from purchases.services.shared.buyers import api_key_issue
from tests.factories import BuyerFactory
from tests.mcp.test_mcp_stock_client import mcp
from tests.x402.e2e import NETWORK, X402World

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "docs/examples/x402_mcp_buy.py"
AMOUNT = 2_500_000
pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def call(base: str, world: X402World, api_key: str, arguments: dict[str, Any]) -> Any:
    """One tools/call of the stock client (Streamable HTTP), in its own process."""
    env = {
        **os.environ,
        "API_KEY": api_key,
        "BUYER_KEY": "0x" + bytes(world.payers[0].key).hex(),
        "TOKEN": world.token,
        "NETWORK": NETWORK,
        "TIMEOUT": "60",
    }
    done = subprocess.run(
        [sys.executable, str(CLIENT), base, "top-up", json.dumps(arguments), "streamable-http"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def balance(base: str, api_key: str, asset: str) -> int:
    response = requests.get(
        f"{base}/api/v1/balance", headers={"Authorization": f"Bearer {api_key}"}, timeout=30
    )
    assert response.status_code == 200, response.text
    return {row["asset"]: int(row["amount"]) for row in response.json()["balances"]}.get(asset, 0)


@pytest.fixture
def world(make_x402_world, settings) -> X402World:
    made = make_x402_world(offering={"slug": "top-up", "top_up": True})
    settings.X402_RESULT_WAIT_SECONDS = 30  # after the world's own (0)
    return made


@pytest.mark.worker
def test_stock_mcp_client_tops_up_the_keys_balance_once(world, asgi_server, start_worker):
    start_worker("w1")
    key = api_key_issue(buyer=BuyerFactory.create())
    # Below the 1 USDC the stock client pays for a USDC it knows without a cap of its own.
    got = call(asgi_server, world, key, {"amount": 900_000})
    assert got["is_error"] is False and got["payment_made"] is True, got
    purchase = Purchase.objects.get()
    assert (purchase.channel, purchase.rail, purchase.amount) == ("mcp", "x402", 900_000)
    body = json.loads(got["content"][0]["text"])["top_up"]
    assert (body["purchase"], body["credited"], body["balance"]) == (
        purchase.ref,
        "900000",
        "900000",
    )
    receipt = got["meta"]["tollbooth/receipt"]
    assert receipt_verify(receipt, addresses=[signing_key().address])
    assert receipt["payload"]["purchase"] == purchase.ref
    settle = got["meta"]["x402/payment-response"]
    assert (
        settle["success"] is True and settle["transaction"] == PaymentAttempt.objects.get().tx_hash
    )
    assert balance(asgi_server, key, world.token) == 900_000

    # The same call again: re-signed inside the duplicate window, the same top-up, not paid.
    again = call(asgi_server, world, key, {"amount": 900_000})
    assert again["meta"]["tollbooth/duplicate-of"] == purchase.ref, again
    assert balance(asgi_server, key, world.token) == 900_000
    assert world.seller_balance() == 900_000 and world.relayer_sent() == 1
    assert LedgerEntry.objects.filter(kind=LedgerEntry.Kind.TOP_UP).count() == 1


def test_the_tool_takes_an_amount_and_needs_the_key(world, asgi_server):
    listed = {tool.name: tool for tool in mcp(asgi_server, "list_tools").tools}
    schema = listed["top-up"].inputSchema
    assert schema["required"] == ["amount"] and schema["properties"]["amount"]["type"] == "integer"
    result = mcp(asgi_server, "call_tool", "top-up", {"amount": AMOUNT})
    assert result.isError is True
    assert json.loads(result.content[1].text)["code"] == "not_authenticated"
    assert not Purchase.objects.exists()
