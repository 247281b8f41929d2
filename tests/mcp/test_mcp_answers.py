"""What a paid tool call that has no result yet, or will have none, tells its agent (issue 34,
part 4), bought through the official `x402.mcp` client, unchanged: it hands `isError: false` to
its caller as the result and pays for an error that carries a PaymentRequired. So pending and
failure answers are error results that say so in words and carry no offer, and calling again
(the client probes and re-signs) is answered from the same purchase: never paid twice.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.utils import timezone
from eth_account import Account
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from x402 import x402Client
from x402.mcp import MCPToolCallResult, create_x402_mcp_client, x402MCPSession
from x402.mechanisms.evm.exact import ExactEvmClientScheme

from doors.mcp.states import POLL_TOOL
from fulfillment.models import ExecutionAttempt
from payments.models import LedgerEntry, PaymentAttempt, Refund
from purchases.models import Purchase
from purchases.selectors import purchase_capability_token
from purchases.services.jobs import reconcile
from purchases.services.shared.buyers import api_key_issue
from tests.factories import BuyerFactory, PaymentAttemptFactory, PurchaseFactory, fund
from tests.x402.e2e import NETWORK, PRICE, X402World

INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\nsouth,5\n"}
# Valid to the schema; the report refuses it for sure when it runs (duplicate column names).
REJECTED = {"title": "Sales", "csv": "region,region\nnorth,3\n"}
pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def payment_client(world: X402World) -> x402Client:
    client = x402Client()
    client.register(NETWORK, ExactEvmClientScheme(signer=Account.from_key(world.payers[0].key)))
    client.set_spend_controls({"allowed_assets": [{"network": NETWORK, "asset": world.token}]})
    return client


async def _buy(base: str, world: X402World, arguments: dict, sse: bool) -> MCPToolCallResult:
    if sse:  # the SDK's own factory
        async with create_x402_mcp_client(payment_client(world), f"{base}/mcp") as session:
            return await session.call_tool(world.offering.slug, arguments)
    async with (
        streamable_http_client(f"{base}/mcp") as (read, write, _),
        ClientSession(read, write) as mcp_session,
    ):
        paying = x402MCPSession(mcp_session, payment_client(world))
        await paying.initialize()
        return await paying.call_tool(world.offering.slug, arguments)


def buy(base: str, world: X402World, arguments: dict, *, sse: bool = False) -> MCPToolCallResult:
    """One call of the stock client, as an agent makes it (a probe, then the paid call)."""
    return asyncio.run(_buy(base, world, arguments, sse))


def said(result: Any) -> tuple[str, dict[str, Any]]:
    """(the words, the structured answer), checked to be the same document twice."""
    content = result.content
    document = json.loads(content[1].text)
    raw = getattr(result, "raw_result", result)
    assert raw.structuredContent == document
    # No offer: nothing a client could take for a payment request and pay again.
    assert "accepts" not in document and "x402Version" not in document
    return content[0].text, document


def meta(result: MCPToolCallResult) -> dict[str, Any]:
    return dict(result.raw_result.meta or {})


async def _plain_call(base: str, name: str, arguments: dict) -> Any:
    async with (
        streamable_http_client(f"{base}/mcp") as (read, write, _),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        return await session.call_tool(name, arguments)


def poll(base: str, arguments: dict) -> Any:
    """The free status tool, called by a plain MCP client (no x402, no key)."""
    return asyncio.run(_plain_call(base, POLL_TOOL, arguments))


def charged_once(world: X402World) -> Purchase:
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1
    assert Purchase.objects.count() == 1 and PaymentAttempt.objects.count() == 1
    return Purchase.objects.get()


def test_paid_work_not_done_is_pending_never_the_result_and_calling_again_never_charges_twice(
    make_x402_world, settings, asgi_server, start_worker
):
    world = make_x402_world()
    settings.X402_RESULT_WAIT_SECONDS = 0  # the work is queued, no worker yet: it waits
    got = buy(asgi_server, world, INPUT)
    assert got.is_error is True and got.payment_made is True
    words, pending = said(got)
    purchase = charged_once(world)
    attempt = PaymentAttempt.objects.get()
    assert words.startswith(f"Not the result yet. Purchase {purchase.ref}: you are charged")
    assert f"or {world.offering.slug} again with the same arguments" in words
    assert (pending["state"], pending["is_result"], pending["awaiting"]) == (
        "pending",
        False,
        "work",
    )
    assert (pending["purchase"], pending["charge"], pending["charged"]) == (
        purchase.ref,
        "charged",
        True,
    )
    assert pending["retry_after_seconds"] == meta(got)["tollbooth/retry-after"] >= 1
    assert pending["ask_again"]["tool"] == world.offering.slug
    assert pending["ask_again"]["status_url"].startswith(f"{asgi_server}/x402/purchases/")
    # The transport's settle response, as the client reads it: settled, this transaction.
    assert got.payment_response.success is True
    assert got.payment_response.transaction == attempt.tx_hash
    assert "tollbooth/receipt" not in meta(got)
    asked = pending["ask_again"]["poll"]
    assert asked["tool"] == POLL_TOOL and asked["arguments"]["purchase"] == purchase.ref
    assert f"call {POLL_TOOL} with {json.dumps(asked['arguments'])} (free)" in words

    # An agent that speaks MCP only polls with the free tool: still pending, nothing paid.
    polled = poll(asgi_server, asked["arguments"])
    assert polled.isError is True and said(polled)[1]["state"] == "pending"
    assert said(polled)[1]["ask_again"]["tool"] == POLL_TOOL

    # The agent calls again: the client probes, gets an offer and re-signs. Same purchase.
    again = buy(asgi_server, world, INPUT, sse=True)
    assert again.is_error is True and said(again)[1]["state"] == "pending"
    assert meta(again)["tollbooth/duplicate-of"] == purchase.ref
    charged_once(world)

    start_worker("w1")
    settings.X402_RESULT_WAIT_SECONDS = 30
    done = buy(asgi_server, world, INPUT)
    assert done.is_error is False, done.content
    assert json.loads(done.content[0].text)["title"] == "Sales"
    assert meta(done)["tollbooth/duplicate-of"] == purchase.ref
    ready = poll(asgi_server, asked["arguments"])  # the free tool now gives the result too
    assert ready.isError is False and json.loads(ready.content[0].text)["title"] == "Sales"
    charged_once(world)
    assert ExecutionAttempt.objects.count() == 1


def test_work_whose_outcome_is_unknown_is_pending_until_the_next_check_never_failed(
    make_x402_world, asgi_server
):
    world = make_x402_world()
    purchase = PurchaseFactory.create(
        paid=True,
        quote__offering=world.offering,
        fulfillment_state=Purchase.FulfillmentState.UNKNOWN,
    )
    PaymentAttemptFactory.create(purchase=purchase, succeeded=True)
    now = timezone.now()
    next_check = now + timedelta(seconds=90)
    ExecutionAttempt.objects.create(
        purchase=purchase,
        executor="report",
        worker="w",
        lease_token="t",
        lease_expires_at=now,
        job_idempotency_key=f"tollbooth-{purchase.ref}",
        started_at=now,
        state="unknown",
        next_check_at=next_check,
    )
    arguments = {"purchase": purchase.ref, "token": purchase_capability_token(ref=purchase.ref)}
    got = poll(asgi_server, arguments)
    assert got.isError is True
    words, pending = said(got)
    assert (pending["state"], pending["awaiting"], pending["charged"]) == (
        "pending",
        "executor",
        True,
    )
    assert pending["ask_again_at"] == next_check.isoformat()
    assert 60 <= pending["retry_after_seconds"] <= 90
    assert "the work's outcome is not known yet (it has not failed)" in words
    assert "fail" not in pending["status"]["execution"]["state"]


@pytest.mark.parametrize(
    "arguments",
    [{}, {"purchase": 7, "token": []}, {"purchase": "pur_x" * 100, "token": "t"}],
)
def test_status_tool_refuses_what_is_no_reference_and_token(asgi_server, arguments):
    got = poll(asgi_server, arguments)
    assert got.isError is True
    words, refused = said(got)
    assert (refused["code"], refused["charged"]) == ("invalid_input", False)
    assert "`purchase` and `token`" in words


def test_status_tool_with_a_wrong_token_says_no_more_than_not_found(
    make_x402_world, settings, asgi_server
):
    world = make_x402_world()
    settings.X402_RESULT_WAIT_SECONDS = 30
    assert buy(asgi_server, world, INPUT).is_error is False
    purchase = Purchase.objects.get()
    got = poll(asgi_server, {"purchase": purchase.ref, "token": "0" * 64})
    words, refused = said(got)
    assert (refused["code"], refused["state"]) == ("purchase_not_found", "refused")
    assert words.startswith("Refused: purchase_not_found")
    assert "Sales" not in got.content[0].text + got.content[1].text


def test_work_rejected_after_payment_says_charged_and_refund_owed_and_is_never_paid_twice(
    make_x402_world, settings, asgi_server
):
    world = make_x402_world()
    settings.X402_RESULT_WAIT_SECONDS = 30  # the report runs in the call itself
    got = buy(asgi_server, world, REJECTED)
    assert got.is_error is True and got.payment_made is True
    words, failed = said(got)
    purchase = charged_once(world)
    refund = Refund.objects.get(purchase=purchase)
    assert refund.state == Refund.State.OWED and refund.amount == PRICE
    assert (failed["state"], failed["code"], failed["purchase"]) == (
        "failed",
        "execution_failed",
        purchase.ref,
    )
    assert (failed["charge"], failed["charged"], failed["is_result"]) == (
        "refund_owed",
        True,
        False,
    )
    assert words.startswith("Failed: execution_failed: ")
    assert f"You were charged {PRICE} (atomic units of {world.token})" in words
    assert f"a refund of {PRICE} is owed to you" in words
    assert got.payment_response.success is True  # the money did move: the client is told so

    again = buy(asgi_server, world, REJECTED, sse=True)
    assert again.is_error is True
    assert said(again)[1]["charge"] == "refund_owed"
    assert meta(again)["tollbooth/duplicate-of"] == purchase.ref
    charged_once(world)
    assert Refund.objects.count() == 1 and ExecutionAttempt.objects.count() == 1


def test_payment_that_failed_for_good_says_failed_and_not_charged(make_x402_world, asgi_server):
    world = make_x402_world(no_mining=True)
    got = buy(asgi_server, world, INPUT)  # broadcast, never mined within the call's wait
    words, pending = said(got)
    assert (pending["awaiting"], pending["charged"]) == ("settlement", None)
    assert "Whether you are charged" not in words  # said once, as what is awaited
    attempt = PaymentAttempt.objects.get()
    # The broadcast is lost and the authorization's window closes, its nonce unused.
    world.node.drop_transaction(attempt.tx_hash)
    world.node.increase_time(3 * 3600)
    world.node.mine()
    reconcile.reconcile_pending_settlements(now=timezone.now() + timedelta(hours=3))
    purchase = Purchase.objects.get()
    assert purchase.payment_state == Purchase.PaymentState.FAILED

    # Polled with the free tool: failed for sure, and not charged.
    polled = poll(asgi_server, pending["ask_again"]["poll"]["arguments"])
    words, failed = said(polled)
    assert (failed["state"], failed["code"], failed["charge"], failed["charged"]) == (
        "failed",
        "payment_failed",
        "not_charged",
        False,
    )
    assert f"Purchase {purchase.ref}. You were not charged for this call." in words
    assert "If your signed authorization still lands before it lapses, it is owed back." in words
    assert world.seller_balance() == 0

    # Polled again: the same answer, from the purchase as it is; still nothing moved.
    assert said(poll(asgi_server, pending["ask_again"]["poll"]["arguments"]))[1] == failed
    assert world.seller_balance() == 0 and Purchase.objects.count() == 1


def test_refused_payment_says_not_charged_and_calling_again_is_never_charged(
    make_x402_world, asgi_server
):
    world = make_x402_world()
    broke = world.new_account()  # gas, but no USDC: its authorization can never settle
    world.payers[0] = broke
    for _ in range(2):  # the agent tries again: refused again, charged never
        got = buy(asgi_server, world, INPUT)
        assert got.is_error is True and got.payment_made is True
        words, refused = said(got)
        assert (refused["code"], refused["state"], refused["charge"], refused["charged"]) == (
            "insufficient_balance",
            "refused",
            "not_charged",
            False,
        )
        assert "You were not charged for this call." in words
    assert world.seller_balance() == 0 and world.relayer_sent() == 0
    assert not ExecutionAttempt.objects.exists()


async def _prepaid_call(base: str, key: str, slug: str, arguments: dict) -> Any:
    http = httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=60)
    async with (
        http,
        streamable_http_client(f"{base}/mcp", http_client=http) as (read, write, _),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        return await session.call_tool(slug, arguments)


def test_prepaid_work_rejected_says_charged_and_refunded_and_debits_once(
    make_x402_world, settings, asgi_server
):
    world = make_x402_world()
    settings.X402_RESULT_WAIT_SECONDS = 30
    buyer = BuyerFactory.create()
    fund(buyer, 10 * PRICE, asset=world.token)
    key = api_key_issue(buyer=buyer)
    for _ in range(2):  # called again: answered from the same purchase
        got = asyncio.run(_prepaid_call(asgi_server, key, world.offering.slug, REJECTED))
        assert got.isError is True
        words, failed = said(got)
        assert (failed["code"], failed["charge"], failed["charged"]) == (
            "execution_failed",
            "refunded",
            True,
        )
        assert f"and {PRICE} of it was refunded" in words
    debits = LedgerEntry.objects.filter(buyer=buyer, kind=LedgerEntry.Kind.PURCHASE_DEBIT)
    assert [entry.amount for entry in debits] == [-PRICE]
    assert Purchase.objects.count() == 1 and Refund.objects.count() == 1
