"""A paid tool call's `arguments` are the purchase's input. The official `x402.mcp` client
(`x402MCPSession`, unchanged) probes with one set of arguments and pays the offer it gets;
the MCP session under it sends the paid call with other arguments, as a client with a bug (or
a hostile one) would. Nothing is charged or recorded for a call that asks for one input and
pays for another; the same arguments are the same purchase, other ones another purchase.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from eth_account import Account
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from x402 import x402Client
from x402.mcp import x402MCPSession
from x402.mechanisms.evm.exact import ExactEvmClientScheme

from core.errors import ErrorCode
from payments.models import PaymentAttempt
from purchases.models import IdempotencyRecord, Purchase
from tests.x402.e2e import NETWORK, PRICE, X402World

INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\nsouth,5\n"}
pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


class PaidArgumentsSwapped:
    """An MCP client session whose paid calls (those carrying `_meta`) send other arguments
    than the probe did; everything else passes through to the SDK's own session."""

    def __init__(self, session: ClientSession, paid_arguments: dict[str, Any] | None) -> None:
        self.session = session
        self.paid_arguments = paid_arguments
        self.paid_meta: dict[str, Any] | None = None

    async def initialize(self) -> Any:
        return await self.session.initialize()

    async def call_tool(self, *, name: str, arguments: dict[str, Any], **options: Any) -> Any:
        if options.get("meta"):
            self.paid_meta = options["meta"]
            if self.paid_arguments is not None:
                arguments = self.paid_arguments
        return await self.session.call_tool(name=name, arguments=arguments, **options)


def payment_client(world: X402World) -> x402Client:
    client = x402Client()
    client.register(NETWORK, ExactEvmClientScheme(signer=Account.from_key(world.payers[0].key)))
    client.set_spend_controls({"allowed_assets": [{"network": NETWORK, "asset": world.token}]})
    return client


async def _buy(
    base: str, world: X402World, arguments: dict, paid_arguments: dict | None, resend: dict | None
) -> tuple[Any, PaidArgumentsSwapped]:
    async with (
        streamable_http_client(f"{base}/mcp") as (read, write, _),
        ClientSession(read, write) as session,
    ):
        swapped = PaidArgumentsSwapped(session, paid_arguments)
        if resend is not None:  # the very same signed payment, sent again as it was
            await session.initialize()
            return await session.call_tool(world.offering.slug, arguments, meta=resend), swapped
        paying = x402MCPSession(swapped, payment_client(world))
        await paying.initialize()
        return await paying.call_tool(world.offering.slug, arguments), swapped


def buy(
    base: str,
    world: X402World,
    arguments: dict,
    *,
    paid_arguments: dict | None = None,
    resend: dict | None = None,
) -> tuple[Any, PaidArgumentsSwapped]:
    return asyncio.run(_buy(base, world, arguments, paid_arguments, resend))


def problem(result: Any) -> dict[str, Any]:
    # content[0] says it in words; content[1] is the problem document's JSON (doors.mcp.states).
    return json.loads([item for item in result.content if item.type == "text"][-1].text)


def nothing_charged(world: X402World) -> None:
    assert world.seller_balance() == 0 and world.relayer_sent() == 0
    assert not Purchase.objects.exists() and not PaymentAttempt.objects.exists()
    assert not IdempotencyRecord.objects.exists()  # the key was never claimed


def test_paid_call_with_invalid_arguments_is_refused_before_anything_is_charged(
    make_x402_world, asgi_server
):
    world = make_x402_world()
    result, swapped = buy(asgi_server, world, INPUT, paid_arguments={"title": 7})
    assert swapped.paid_meta is not None  # the client did pay: its signed payment was sent
    assert result.is_error is True and result.payment_made is True
    body = problem(result)
    assert body["code"] == ErrorCode.INVALID_INPUT and body["next_action"] == "fix_input"
    assert {e["path"] for e in body["errors"]} == {"", "title"}  # csv missing, title no string
    nothing_charged(world)


def test_paid_call_whose_arguments_are_not_the_quotes_input_is_refused(
    make_x402_world, asgi_server
):
    world = make_x402_world()
    other = {**INPUT, "title": "Something else"}
    result, _ = buy(asgi_server, world, INPUT, paid_arguments=other)
    assert result.is_error is True
    body = problem(result)
    assert (body["code"], body["next_action"]) == (ErrorCode.INPUT_MISMATCH, "request_quote")
    assert body["retryable"] is False
    nothing_charged(world)


def test_same_arguments_buy_once_and_the_same_payment_with_other_arguments_is_refused(
    make_x402_world, settings, asgi_server
):
    world = make_x402_world()
    # The report runs in the call: a result, not a pending answer (an error result).
    settings.X402_RESULT_WAIT_SECONDS = 30
    bought, swapped = buy(asgi_server, world, INPUT)
    assert bought.is_error is False, problem(bought)
    purchase = Purchase.objects.get()
    assert purchase.quote.canonical_input == INPUT
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1

    # The very same signed payment (its key: network, payer, nonce), resent with other
    # arguments: never the first call's answer, never a second purchase.
    other = {**INPUT, "csv": "region,units\nwest,1\n"}
    again, _ = buy(asgi_server, world, other, resend=swapped.paid_meta)
    assert again.isError is True and problem(again)["code"] == ErrorCode.INPUT_MISMATCH
    # ... and with its own arguments it is the same purchase's stored answer.
    same, _ = buy(asgi_server, world, INPUT, resend=swapped.paid_meta)
    assert same.isError is False
    assert Purchase.objects.count() == 1 and world.relayer_sent() == 1

    # Other arguments, paid for as the stock client does (a probe, its offer): another purchase.
    second, _ = buy(asgi_server, world, other)
    assert second.is_error is False, problem(second)
    assert Purchase.objects.count() == 2 and world.seller_balance() == 2 * PRICE
    assert Purchase.objects.exclude(pk=purchase.pk).get().quote.canonical_input == other
