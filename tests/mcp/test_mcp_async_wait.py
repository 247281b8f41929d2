"""A tool call paid over x402 waiting for its block holds no thread (doors/mcp).

The ASGI app (config/asgi.py) serves `/mcp` with ONE thread for MCP domain calls
(TOLLBOOTH_MCP_THREADS=1) and ONE for x402 payments' synchronous parts
(TOLLBOOTH_X402_THREADS=1), on a chain that mines only when told. Several buyers call the
paid tool at once with the MCP SDK's own client: every payment is broadcast (all in the pool
together) while none is mined, which a call holding its thread for the wait would forbid
(the second payment could not even be taken until the first was mined). One block then
settles them all, and each is answered as a call that never waited is. A client gone
mid-wait does not stop the settlement being recorded nor the work from running, once.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from mcp import ClientSession, types
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client

from fulfillment.models import ExecutionAttempt
from payments.models import PaymentAttempt
from purchases.models import Purchase
from tests.x402.e2e import NETWORK, PRICE, X402World, sign_payment

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
INPUT = {"title": "Waiting", "csv": "region,units\nnorth,3\n"}
PAYMENT_META = "x402/payment"
PAYMENT_RESPONSE_META = "x402/payment-response"
TRANSPORTS = ["streamable-http", "sse"]


@asynccontextmanager
async def _session(base: str, transport: str) -> AsyncIterator[ClientSession]:
    """The MCP SDK's own client over either transport the server speaks."""
    if transport == "sse":
        streams = sse_client(f"{base}/mcp/sse")
    else:
        streams = streamable_http_client(f"{base}/mcp")
    async with streams as (read, write, *_), ClientSession(read, write) as session:
        await session.initialize()
        yield session


async def _call(
    base: str, tool: str, meta: dict[str, Any] | None, transport: str = "streamable-http"
) -> types.CallToolResult:
    async with _session(base, transport) as session:
        return await session.call_tool(tool, INPUT, meta=meta)


def _signed(base: str, world: X402World, index: int) -> dict[str, Any]:
    """Probe unpaid (the offer), then sign it as the x402 MCP client does: `_meta` payment."""
    offer = asyncio.run(_call(base, world.offering.slug, None))
    assert offer.isError is True and offer.structuredContent, offer
    required = base64.b64encode(json.dumps(offer.structuredContent).encode()).decode()
    header = sign_payment(required, world.payers[index], f"mcp-async-wait-{index:04d}-id")
    return {PAYMENT_META: json.loads(base64.b64decode(header))}


def _in_background(
    base: str, tool: str, metas: list[dict[str, Any]], transport: str
) -> tuple[threading.Thread, list[Any], Callable[[], None]]:
    """Every paid call at once, each on its own connection, on a loop of their own; and a
    way to cut them all off as a client going away does."""
    answers: list[Any] = [None] * len(metas)
    loop = asyncio.new_event_loop()
    tasks: list[asyncio.Task[Any]] = []

    async def one(index: int) -> None:
        try:
            answers[index] = await _call(base, tool, metas[index], transport)
        except BaseException as error:  # the test reads it (a cancelled call): kept, not raised
            answers[index] = error

    async def run() -> None:
        tasks.extend(asyncio.create_task(one(i)) for i in range(len(metas)))
        await asyncio.gather(*tasks, return_exceptions=True)

    def serve() -> None:
        loop.run_until_complete(run())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def disconnect() -> None:
        for task in tasks:
            loop.call_soon_threadsafe(task.cancel)

    return thread, answers, disconnect


def _until(done: Callable[[], bool], what: Callable[[], Any]) -> None:
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline, what()
        time.sleep(0.05)


def _answered_as(result: types.CallToolResult, purchase: Purchase) -> dict[str, Any]:
    """What a buyer reads in a result, with what differs between purchases named."""
    assert result.meta is not None, result
    attempt = PaymentAttempt.objects.get(purchase=purchase)
    settle = result.meta[PAYMENT_RESPONSE_META]
    assert settle["transaction"] == attempt.tx_hash and settle["payer"] == purchase.payer, settle
    return {
        "is_error": result.isError,
        "content": [
            item.text if isinstance(item, types.TextContent) else item.type
            for item in result.content
        ],
        "meta": sorted(result.meta),
        "settle": {
            key: value for key, value in settle.items() if key not in ("transaction", "payer")
        },
    }


def _purchase_of(meta: dict[str, Any]) -> Purchase:
    payer = meta[PAYMENT_META]["payload"]["authorization"]["from"]
    return Purchase.objects.get(payer__iexact=payer)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_more_paid_tool_calls_wait_for_their_block_at_once_than_threads(
    make_x402_world, settings, start_asgi_server, transport
):
    world = make_x402_world(no_mining=True)
    # Long enough that no wait ends by timing out: only the block ends them.
    settings.X402_NETWORKS[NETWORK]["confirmation_timeout"] = 60.0
    settings.X402_RESULT_WAIT_SECONDS = 10  # `report` runs in the call: the result
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "X402_THREADS": 1, "MCP_THREADS": 1}
    settings.ALLOWED_HOSTS = ["127.0.0.1"]
    base = start_asgi_server()
    tool = world.offering.slug

    # The answer of a call that never waited: its block was there at the first look.
    world.node.set_automine(True)
    reference_meta = _signed(base, world, 0)
    reference = asyncio.run(_call(base, tool, reference_meta))
    world.node.set_automine(False)
    expected = _answered_as(reference, _purchase_of(reference_meta))
    assert expected["is_error"] is False and expected["settle"]["success"] is True, reference

    waiting = range(1, len(world.payers))  # every other payer, more calls than threads
    metas = [_signed(base, world, i) for i in waiting]
    thread, answers, _ = _in_background(base, tool, metas, transport)

    # Every payment broadcast and waiting at once, on one thread: none mined yet.
    _until(
        lambda: world.relayer_sent() == 1 + len(metas),
        lambda: (answers, f"{world.relayer_sent() - 1} of {len(metas)} broadcast, none mined"),
    )
    assert answers == [None] * len(metas)  # all waiting for the block
    # ... and no thread held by them: another buyer's call is answered meanwhile (its offer).
    offer = asyncio.run(_call(base, tool, None, transport))
    assert offer.isError is True and (offer.structuredContent or {}).get("accepts"), offer
    assert Purchase.objects.filter(payment_state="paid").count() == 1  # the reference only

    world.node.mine()
    thread.join(timeout=60)
    assert not thread.is_alive()
    for meta, answer in zip(metas, answers, strict=True):
        assert isinstance(answer, types.CallToolResult), answer
        assert _answered_as(answer, _purchase_of(meta)) == expected
    assert world.seller_balance() == len(world.payers) * PRICE
    assert sorted(Purchase.objects.values_list("payment_state", flat=True)) == ["paid"] * len(
        world.payers
    )
    # One broadcast each, recorded as the blocking wait records it; each work run once.
    assert PaymentAttempt.objects.filter(state="succeeded").count() == len(world.payers)
    assert ExecutionAttempt.objects.count() == len(world.payers)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_client_gone_mid_wait_still_has_its_payment_recorded_and_its_work_run_once(
    make_x402_world, settings, start_asgi_server, transport
):
    world = make_x402_world(no_mining=True)
    settings.X402_NETWORKS[NETWORK]["confirmation_timeout"] = 60.0
    settings.X402_RESULT_WAIT_SECONDS = 10
    settings.ALLOWED_HOSTS = ["127.0.0.1"]
    base = start_asgi_server()
    meta = _signed(base, world, 0)
    thread, answers, disconnect = _in_background(base, world.offering.slug, [meta], transport)
    _until(lambda: world.relayer_sent() == 1, lambda: (answers, "not broadcast"))

    disconnect()  # the client goes away while its payment waits for its block
    thread.join(timeout=30)
    assert not thread.is_alive() and isinstance(answers[0], asyncio.CancelledError), answers
    world.node.mine()

    # Nobody is there to be answered: the server still records the settlement and runs the work.
    purchase = _purchase_of(meta)
    _until(
        lambda: ExecutionAttempt.objects.filter(purchase=purchase, state="succeeded").exists(),
        lambda: (
            Purchase.objects.values().get(pk=purchase.pk),
            list(ExecutionAttempt.objects.values()),
        ),
    )
    purchase.refresh_from_db()
    assert purchase.payment_state == "paid"
    assert PaymentAttempt.objects.get(purchase=purchase).state == "succeeded"
    assert ExecutionAttempt.objects.filter(purchase=purchase).count() == 1
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1
