"""The MCP door's refund-request tool (issue 33, part 2), called by a plain MCP SDK client
over Streamable HTTP: listed beside the offerings' tools; the paying wallet's signed request
opens a request, which the tool then polls; another wallet's signature is a problem result;
with an API key on the connection the key's buyer asks."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from doors.mcp.refund_tool import NAME
from payments.refund_request_signing import signed_request_sign
from purchases.models import RefundRequest
from purchases.services.shared.buyers import api_key_issue
from tests.factories import BuyerFactory
from tests.purchases.test_refund_requests import OTHER_WALLET, WALLET, settled_purchase

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


async def _session_call(base: str, headers: dict[str, str], method: str, *args: Any) -> Any:
    import httpx

    async with (
        httpx.AsyncClient(headers=headers) as http,
        streamable_http_client(f"{base}/mcp", http_client=http) as (read, write, _),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        return await getattr(session, method)(*args)


def mcp(base: str, method: str, *args: Any, headers: dict[str, str] | None = None) -> Any:
    return asyncio.run(_session_call(base, headers or {}, method, *args))


def _signed(ref: str, network: str, signer: Any) -> dict[str, Any]:
    message = {
        "purchase": ref,
        "amount": 1000,
        "reason": "empty report",
        "idempotencyKey": "mcp-refund-key-000001",
        "expiry": int(time.time()) + 600,
    }
    return signed_request_sign(message=message, network=network, private_key=signer.key)


def test_the_tool_is_listed_and_the_payers_signed_request_opens_and_polls(asgi_server: str):
    purchase = settled_purchase()
    tools = {tool.name for tool in mcp(asgi_server, "list_tools").tools}
    assert NAME in tools

    refused = mcp(
        asgi_server,
        "call_tool",
        NAME,
        {"purchase": purchase.ref, "signed": _signed(purchase.ref, purchase.network, OTHER_WALLET)},
    )
    assert refused.isError is True
    assert refused.structuredContent["code"] == "refund_request_signature_invalid"
    assert not RefundRequest.objects.exists()

    opened = mcp(
        asgi_server,
        "call_tool",
        NAME,
        {"purchase": purchase.ref, "signed": _signed(purchase.ref, purchase.network, WALLET)},
    )
    assert opened.isError is False, opened.content
    document = opened.structuredContent
    assert (document["status"], document["channel"]) == ("pending", "wallet_signature")
    polled = mcp(
        asgi_server, "call_tool", NAME, {"purchase": purchase.ref, "refund_request": document["id"]}
    )
    assert polled.structuredContent["id"] == document["id"]
    assert RefundRequest.objects.count() == 1


def test_with_an_api_key_the_keys_buyer_asks(asgi_server: str):
    buyer = BuyerFactory.create()
    purchase = settled_purchase(buyer=buyer)
    headers = {"Authorization": f"Bearer {api_key_issue(buyer=buyer)}"}
    arguments = {
        "purchase": purchase.ref,
        "amount": "2500",
        "reason": "late",
        "idempotency_key": "mcp-refund-key-000002",
    }
    first = mcp(asgi_server, "call_tool", NAME, arguments, headers=headers)
    assert first.isError is False, first.content
    assert (first.structuredContent["channel"], first.structuredContent["amount"]) == (
        "api_key",
        "2500",
    )
    again = mcp(asgi_server, "call_tool", NAME, arguments, headers=headers)
    assert again.structuredContent["id"] == first.structuredContent["id"]
    above = mcp(
        asgi_server,
        "call_tool",
        NAME,
        {**arguments, "amount": "99999999", "idempotency_key": "mcp-refund-key-000003"},
        headers=headers,
    )
    assert above.structuredContent["code"] == "refund_request_open"
    assert RefundRequest.objects.count() == 1
