"""The MCP server: tools/list and tools/call over Streamable HTTP (`/mcp`, stateless) and SSE
(`/mcp/sse`, messages posted to `/mcp/messages/`), as one ASGI app config/asgi.py mounts
beside Django (docs/mcp.md).

Nothing about a purchase lives in this process's memory: Streamable HTTP runs stateless (any
replica answers any request), and every purchase step is in the database, so a client that
reconnects to another replica and calls again is answered from the same purchase.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
from django.conf import settings
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.sse import SseServerTransport
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

from doors.mcp.calls import ToolCall, tool_call, tools_list
from doors.mcp.refund_tool import refund_tool
from doors.mcp.sse_relay import SseRelay
from doors.x402.paid_async import run_paid_call
from doors.x402.waiting import Waiting

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

STREAMABLE_PATHS = ("/mcp", "/mcp/")
SSE_PATH = "/mcp/sse"
MESSAGES_PATH = "/mcp/messages/"


def _server(limiter: anyio.CapacityLimiter) -> Server[Any, Any]:
    server: Server[Any, Any] = Server("tollbooth", instructions=_INSTRUCTIONS)

    @server.list_tools()  # type: ignore[no-untyped-call, untyped-decorator]
    async def list_tools() -> list[types.Tool]:
        offers = await anyio.to_thread.run_sync(tools_list, limiter=limiter)
        return [
            types.Tool.model_validate(
                {
                    "name": offer.name,
                    "title": offer.title,
                    "description": offer.description,
                    "inputSchema": offer.input_schema,
                    "_meta": offer.meta,
                }
            )
            for offer in offers
        ] + [refund_tool()]

    # Our own validation (the offering's schema, volatile fields, size cap) answers with
    # every violation, and the SDK's tool cache would outlive an offering's schema change.
    @server.call_tool(validate_input=False)  # type: ignore[untyped-decorator]
    async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        context = server.request_context
        meta = context.meta.model_dump(by_alias=True, exclude_none=True) if context.meta else {}
        request = context.request
        call = ToolCall(
            name=name,
            arguments=arguments,
            meta=meta,
            authorization=request.headers.get("authorization") if request else None,
            base_url=f"{request.url.scheme}://{request.url.netloc}" if request else "",
        )
        if call.pays_over_x402:
            # An x402 payment, as the paid URL's (paid_async): its synchronous parts run in
            # the X402_THREADS pool, and its wait for the block sleeps on this loop.
            return await run_paid_call(lambda: tool_call(call))
        # Domain calls are synchronous (the ORM): each runs in a worker thread, at most
        # MCP_THREADS at once per process.
        return await anyio.to_thread.run_sync(_unpaid_call, call, limiter=limiter)

    return server


def _unpaid_call(call: ToolCall) -> types.CallToolResult:
    answered = tool_call(call)
    # Only an x402 payment's call, run with waits returned (run_paid_call), answers Waiting.
    assert not isinstance(answered, Waiting)
    return answered


_INSTRUCTIONS = (
    "Each tool is a paid offering. Call it: without payment you get the x402 PaymentRequired "
    "(isError, structuredContent); pay with _meta['x402/payment'], or send "
    "'Authorization: Bearer <api key>' on the connection to pay from a prepaid balance. "
    "Calling again with the same input (even re-signed) inside the duplicate window is "
    "answered with the same purchase, never charged twice. A paid call with no result is an "
    "error result that says why: structuredContent.state 'pending' (not the result yet: ask "
    "again after retry_after_seconds, the same call or the status URL), or 'failed' / "
    "'refused' with 'charged' (true, false, or null while the payment settles) and 'charge' "
    "(not_charged, settling, charged, refund_owed, refunded, under_review)."
)


class McpApp:
    """The `/mcp` ASGI app; `lifespan()` must be running while it serves Streamable HTTP."""

    def __init__(self) -> None:
        self.limiter = anyio.CapacityLimiter(settings.TOLLBOOTH["MCP_THREADS"])
        self.server = _server(self.limiter)
        self.streamable = StreamableHTTPSessionManager(app=self.server, stateless=True)
        self.sse = SseServerTransport(MESSAGES_PATH)
        # Any worker of any replica may receive an SSE session's messages (sse_relay).
        self.relay = SseRelay(self.sse, settings.REDIS_URL)

    @asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        async with self.streamable.run():
            yield

    @staticmethod
    def handles(path: str) -> bool:
        return path in STREAMABLE_PATHS or path.startswith("/mcp/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if path in STREAMABLE_PATHS:
            await self.streamable.handle_request(scope, receive, send)  # type: ignore[arg-type]
        elif path == SSE_PATH:
            await self._sse(scope, receive, send)
        elif path.startswith(MESSAGES_PATH):
            await self.relay.post(scope, receive, send)
        else:
            await _not_found(send)

    async def _sse(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with self.relay.connect(scope, receive, send) as (read, write):
            await self.server.run(read, write, self.server.create_initialization_options())


async def _not_found(send: Send) -> None:
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b""})
