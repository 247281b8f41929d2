"""SSE across processes: an SSE session lives in the one worker process holding its stream,
but its messages are POSTed to `/mcp/messages/?session_id=…` and may reach any worker of any
replica. With Redis (REDIS_URL, which production requires), a POST for a session this process
does not hold is published on the session's channel; the process holding the stream
subscribes to it and hands the message to the SDK's transport, with the POST's headers (the
API key). Without Redis (the embedded demo, one worker) every POST is handled locally.

Only the SDK's public ASGI entry points are used: the session id is read from the stream's
own first event (`endpoint`), and a relayed message is replayed as a POST.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any
from urllib.parse import parse_qs

from mcp.server.sse import SseServerTransport

_SESSION_IN_ENDPOINT = re.compile(rb"session_id=([0-9a-f]{32})")
_CHANNEL = "tollbooth:mcp-sse:{}"


class SseRelay:
    def __init__(self, transport: SseServerTransport, redis_url: str) -> None:
        self.transport = transport
        self.redis_url = redis_url
        self.local: set[str] = set()
        self._redis: Any = None

    def _client(self) -> Any:
        if self._redis is None:
            import redis.asyncio

            self._redis = redis.asyncio.Redis.from_url(self.redis_url)
        return self._redis

    async def post(self, scope: Any, receive: Any, send: Any) -> None:
        session = parse_qs(scope.get("query_string", b"").decode()).get("session_id", [""])[0]
        if not self.redis_url or session.replace("-", "") in self.local:
            await self.transport.handle_post_message(scope, receive, send)
            return
        body = await _read_body(receive)
        message = {
            "query": scope.get("query_string", b"").decode(),
            "headers": [[k.decode(), v.decode()] for k, v in scope.get("headers", [])],
            "body": base64.b64encode(body).decode(),
        }
        channel = _CHANNEL.format(session.replace("-", ""))
        receivers = await self._client().publish(channel, json.dumps(message))
        # 202 as the SDK answers a message it accepted; 404 as it answers an unknown session.
        await _answer(send, 202 if receivers else 404, b"Accepted" if receivers else b"")

    @asynccontextmanager
    async def connect(self, scope: Any, receive: Any, send: Any) -> AsyncIterator[Any]:
        """The SDK's connect_sse, plus: learn the session id from the stream's first event
        and subscribe to its channel before that event reaches the client (whose first POST
        follows at once), then relay what other processes publish there."""
        found: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        session = ""

        async def sniffing_send(message: Any) -> None:
            nonlocal session
            if not session and message.get("type") == "http.response.body":
                match = _SESSION_IN_ENDPOINT.search(message.get("body", b""))
                if match:
                    session = match.group(1).decode()
                    self.local.add(session)
                    found.set_result(await self._subscribe(session))
            await send(message)

        async with self.transport.connect_sse(scope, receive, sniffing_send) as streams:
            task = asyncio.create_task(self._relay(found, scope))
            try:
                yield streams
            finally:
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
                self.local.discard(session)

    async def _subscribe(self, session: str) -> Any:
        if not self.redis_url:
            return None
        pubsub = self._client().pubsub()
        await pubsub.subscribe(_CHANNEL.format(session))
        return pubsub

    async def _relay(self, found: asyncio.Future[Any], scope: Any) -> None:
        pubsub = await found
        if pubsub is None:
            return
        try:
            async for item in pubsub.listen():
                if item.get("type") == "message":
                    await self._deliver(json.loads(item["data"]), scope)
        finally:
            with suppress(Exception):
                await pubsub.unsubscribe()
                await pubsub.aclose()

    async def _deliver(self, message: dict[str, Any], stream_scope: Any) -> None:
        """Replay a relayed POST into the SDK's transport, in this process."""
        body = base64.b64decode(message["body"])
        scope = {
            **stream_scope,
            "method": "POST",
            "path": stream_scope["path"].replace("/sse", "/messages/"),
            "query_string": message["query"].encode(),
            "headers": [(k.encode(), v.encode()) for k, v in message["headers"]],
        }
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                await asyncio.Event().wait()  # no disconnect: the relay owns no socket
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def discard(_: Any) -> None:
            return None

        await self.transport.handle_post_message(scope, receive, discard)


async def _read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _answer(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": body})
