"""The MCP door, bought through as agents do: the official `x402.mcp` client, unchanged, over
SSE (the SDK's own factory) and Streamable HTTP, against the ASGI app on a live server, with
a real worker and the shared anvil chain. A prepaid buyer calls the same tool with its API
key on the connection.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from fulfillment.models import ExecutionAttempt
from fulfillment.receipt_signing import receipt_verify, signing_key
from payments.models import LedgerEntry, PaymentAttempt
from purchases.models import Purchase
from purchases.services.shared.buyers import api_key_issue
from tests.factories import BuyerFactory, fund
from tests.x402.e2e import NETWORK, PRICE, X402World

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "docs/examples/x402_mcp_buy.py"
INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\nsouth,5\n"}
pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def buy(base: str, tool: str, world: X402World | None, transport: str, **env: str) -> Any:
    """One call of the stock client, in its own process: what its caller gets back."""
    if world is not None:
        env |= {
            "BUYER_KEY": "0x" + bytes(world.payers[0].key).hex(),
            "TOKEN": world.token,
            "NETWORK": NETWORK,
        }
    done = subprocess.run(
        [sys.executable, str(CLIENT), base, tool, json.dumps(INPUT), transport],
        cwd=ROOT,
        env={**os.environ, "TIMEOUT": "60", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


async def _session_call(base: str, method: str, *args: Any) -> Any:
    async with (
        streamable_http_client(f"{base}/mcp") as (read, write, _),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        return await getattr(session, method)(*args)


def mcp(base: str, method: str, *args: Any) -> Any:
    """A plain MCP SDK client session (no x402 at all)."""
    return asyncio.run(_session_call(base, method, *args))


def test_tools_list_names_every_active_offering_with_its_schema_and_price(
    make_x402_world, asgi_server
):
    world = make_x402_world()
    listed = {tool.name: tool for tool in mcp(asgi_server, "list_tools").tools}
    tool = listed[world.offering.slug]
    assert tool.inputSchema == world.offering.input_schema
    assert tool.description == world.offering.description or world.offering.title
    price = tool.meta["tollbooth/price"]
    assert price == {
        "amount": str(PRICE),
        "asset": world.token,
        "network": NETWORK,
        "payTo": world.seller.address,
        "duplicateWindowSeconds": int(world.offering.duplicate_window.total_seconds()),
    }
    assert tool.meta["x402/accepts"][0]["amount"] == str(PRICE)


def test_unpaid_call_is_an_error_result_carrying_the_payment_required(make_x402_world, asgi_server):
    world = make_x402_world()
    result = mcp(asgi_server, "call_tool", world.offering.slug, INPUT)
    assert result.isError is True
    required = result.structuredContent
    assert required["x402Version"] == 2 and json.loads(result.content[0].text) == required
    (accepts,) = required["accepts"]
    assert accepts["amount"] == str(PRICE) and accepts["payTo"] == world.seller.address
    assert accepts["extra"]["quote"].startswith("qt_")
    assert required["resource"]["url"] == f"{asgi_server}/mcp"
    # Nothing was bought and nothing ran.
    assert not Purchase.objects.exists() and not ExecutionAttempt.objects.exists()


@pytest.mark.worker
@pytest.mark.parametrize("transport", ["sse", "streamable-http"])
def test_stock_client_buys_and_its_re_signed_retry_is_never_charged(
    make_x402_world, settings, asgi_server, start_worker, transport
):
    world = make_x402_world()
    settings.X402_RESULT_WAIT_SECONDS = 30
    start_worker("w1")
    got = buy(asgi_server, world.offering.slug, world, transport)
    assert got["is_error"] is False and got["payment_made"] is True, got
    assert json.loads(got["content"][0]["text"])["title"] == "Sales"
    settle = got["meta"]["x402/payment-response"]
    attempt = PaymentAttempt.objects.get()
    assert settle["success"] is True and settle["transaction"] == attempt.tx_hash
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1
    purchase = Purchase.objects.get()
    assert purchase.channel == Purchase.Channel.MCP and purchase.rail == "x402"
    # Settled at its finality depth: the tool result carries the signed receipt in `_meta`.
    receipt = got["meta"]["tollbooth/receipt"]
    assert receipt_verify(receipt, addresses=[signing_key().address])
    assert (receipt["payload"]["purchase"], receipt["payload"]["transaction"]) == (
        purchase.ref,
        attempt.tx_hash,
    )

    # The same call again: the stock client probes, gets a new quote and signs a new
    # authorization (new nonce). Same payer, tool and input inside the duplicate window:
    # answered from the same purchase, never settled.
    again = buy(asgi_server, world.offering.slug, world, transport)
    assert again["is_error"] is False, again
    assert json.loads(again["content"][0]["text"])["title"] == "Sales"
    assert again["meta"]["tollbooth/duplicate-of"] == purchase.ref
    assert again["meta"]["tollbooth/receipt"] == receipt  # the same receipt, not a new one
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1
    assert Purchase.objects.count() == 1 and PaymentAttempt.objects.count() == 1
    assert ExecutionAttempt.objects.count() == 1


@pytest.mark.worker
def test_prepaid_buyer_calls_the_tool_with_its_api_key_and_pays_once(
    make_x402_world, settings, asgi_server, start_worker
):
    world = make_x402_world()
    settings.X402_RESULT_WAIT_SECONDS = 30
    start_worker("w1")
    buyer = BuyerFactory.create()
    fund(buyer, 10 * PRICE, asset=world.token)
    key = api_key_issue(buyer=buyer)
    got = buy(asgi_server, world.offering.slug, None, "streamable-http", API_KEY=key)
    assert got["is_error"] is False, got
    assert json.loads(got["content"][0]["text"])["title"] == "Sales"
    assert "x402/payment-response" not in got["meta"]  # nothing settled on a chain
    purchase = Purchase.objects.get()
    assert (purchase.rail, purchase.channel, purchase.buyer) == ("prepaid", "mcp", buyer)
    receipt = got["meta"]["tollbooth/receipt"]  # a debit is final at once: signed with the result
    assert receipt_verify(receipt, addresses=[signing_key().address])
    assert (receipt["payload"]["network"], receipt["payload"]["purchase"]) == (
        "prepaid",
        purchase.ref,
    )

    again = buy(asgi_server, world.offering.slug, None, "streamable-http", API_KEY=key)
    assert json.loads(again["content"][0]["text"])["title"] == "Sales"
    debits = LedgerEntry.objects.filter(buyer=buyer, kind=LedgerEntry.Kind.PURCHASE_DEBIT)
    assert [entry.amount for entry in debits] == [-PRICE]
    assert Purchase.objects.count() == 1 and world.relayer_sent() == 0


@pytest.mark.worker
def test_pending_settlement_says_so_runs_nothing_and_the_repeated_call_gets_the_result(
    make_x402_world, settings, asgi_server, start_worker
):
    world = make_x402_world(no_mining=True)
    settings.X402_RESULT_WAIT_SECONDS = 30
    start_worker("w1")
    # The broadcast waits in the pool: the server's wait for its receipt (2 s) runs out.
    got = buy(asgi_server, world.offering.slug, world, "sse")
    # Never the result: an error result that says so, and carries no offer to pay again.
    assert got["is_error"] is True and got["payment_made"] is True, got
    said, document, link = got["content"]
    assert said["text"].startswith("Not the result yet.")
    pending = json.loads(document["text"])
    assert "accepts" not in pending and "x402Version" not in pending
    body = pending["status"]
    purchase = Purchase.objects.get()
    attempt = PaymentAttempt.objects.get()
    assert (pending["state"], pending["awaiting"], pending["charged"]) == (
        "pending",
        "settlement",
        None,
    )
    assert pending["purchase"] == purchase.ref and pending["transaction"] == attempt.tx_hash
    assert body["status"] == "settlement_pending" and body["purchase"] == purchase.ref
    assert body["transaction"] == attempt.tx_hash and body["next_action"] == "poll_status_url"
    assert pending["ask_again"]["status_url"] == body["status_url"]
    assert link["type"] == "resource_link" and link["uri"] == body["status_url"]
    assert link["uri"].startswith(f"{asgi_server}/x402/purchases/{purchase.ref}/")
    settle = got["meta"]["x402/payment-response"]
    assert settle["success"] is False and settle["errorReason"] == "settlement_pending"
    assert settle["transaction"] == attempt.tx_hash
    # Never run before settling, and no receipt while the settlement is pending.
    assert not ExecutionAttempt.objects.exists()
    assert "tollbooth/receipt" not in got["meta"]

    world.node.mine()  # the one broadcast lands
    again = buy(asgi_server, world.offering.slug, world, "sse")  # re-signed: a new nonce
    assert again["is_error"] is False, again
    assert json.loads(again["content"][0]["text"])["title"] == "Sales"
    assert again["meta"]["tollbooth/duplicate-of"] == purchase.ref
    assert again["meta"]["tollbooth/receipt"]["payload"]["purchase"] == purchase.ref
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1
    assert Purchase.objects.count() == 1 and PaymentAttempt.objects.count() == 1


def test_payment_that_cannot_settle_is_refused_and_no_work_runs(make_x402_world, asgi_server):
    world = make_x402_world()
    broke = world.new_account()  # gas, but no USDC: its authorization can never settle
    env = {"BUYER_KEY": "0x" + bytes(broke.key).hex(), "TOKEN": world.token, "NETWORK": NETWORK}
    got = buy(asgi_server, world.offering.slug, None, "streamable-http", **env)
    assert got["is_error"] is True and got["payment_made"] is True, got
    said, document = got["content"]
    problem = json.loads(document["text"])
    assert problem["code"] == "insufficient_balance", problem
    assert (problem["state"], problem["charge"], problem["charged"]) == (
        "refused",
        "not_charged",
        False,
    )
    assert "You were not charged" in said["text"]
    assert "accepts" not in problem  # a refusal, not a new offer: the client does not re-pay
    assert not ExecutionAttempt.objects.exists()
    assert world.seller_balance() == 0 and world.relayer_sent() == 0
