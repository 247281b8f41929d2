"""Call a Tollbooth MCP tool with the official x402 Python MCP client (`x402.mcp`), unmodified.

    python docs/examples/x402_mcp_buy.py BASE_URL TOOL '{"title": "Sales", "csv": "a,b\\n1,2\\n"}' \
        [sse|streamable-http]

x402 (BUYER_KEY, TOKEN, NETWORK set): over SSE the SDK's own factory,
`create_x402_mcp_client(client, BASE_URL + "/mcp")` (it appends `/sse`); over Streamable HTTP
the SDK's `x402MCPSession` around the MCP SDK's own client session; with API_KEY set too, the
key rides on the connection (a top-up tool credits its balance). Prepaid (API_KEY set, no
BUYER_KEY): a plain MCP client session with `Authorization: Bearer <API_KEY>` on the
connection.
TIMEOUT (seconds) bounds the call. Prints what the caller got as one JSON line. The tests run
this file as it is (tests/mcp/test_mcp_stock_client.py).
"""

import asyncio
import json
import os
import sys
from datetime import timedelta

import httpx
from eth_account import Account
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from x402 import x402Client
from x402.mcp import create_x402_mcp_client, x402MCPSession
from x402.mechanisms.evm.exact import ExactEvmClientScheme

base, tool, arguments = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
transport = sys.argv[4] if len(sys.argv) > 4 else "sse"
timeout = timedelta(seconds=float(os.environ.get("TIMEOUT", "60")))


def payment_client() -> x402Client:
    network, token = os.environ["NETWORK"], os.environ["TOKEN"]
    client = x402Client()
    client.register(network, ExactEvmClientScheme(signer=Account.from_key(os.environ["BUYER_KEY"])))
    # The client pays well-known USDC addresses only; a local test token must be allowed.
    client.set_spend_controls({"allowed_assets": [{"network": network, "asset": token}]})
    return client


def printed(content, is_error, meta, payment_made):
    return {
        "is_error": bool(is_error),
        "payment_made": payment_made,
        "content": [item.model_dump(mode="json", by_alias=True) for item in content],
        "meta": meta or {},
    }


async def x402_call():
    if transport == "sse":
        async with create_x402_mcp_client(payment_client(), f"{base}/mcp") as session:
            result = await session.call_tool(tool, arguments, read_timeout_seconds=timeout)
    else:
        async with (
            keyed_http() as http,
            streamable_http_client(f"{base}/mcp", http_client=http) as (read, write, _),
            ClientSession(read, write) as mcp_session,
        ):
            session = x402MCPSession(mcp_session, payment_client())
            await session.initialize()
            result = await session.call_tool(tool, arguments, read_timeout_seconds=timeout)
    raw = result.raw_result
    return printed(result.content, result.is_error, raw.meta if raw else None, result.payment_made)


def keyed_http():
    """The connection's HTTP client, with the API key when one is set."""
    key = os.environ.get("API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(30, read=300))


async def prepaid_call():
    async with (
        keyed_http() as http,
        streamable_http_client(f"{base}/mcp", http_client=http) as (read, write, _),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        result = await session.call_tool(tool, arguments, read_timeout_seconds=timeout)
    return printed(result.content, result.isError, result.meta, False)


got = asyncio.run(x402_call() if os.environ.get("BUYER_KEY") else prepaid_call())
print(json.dumps(got))
