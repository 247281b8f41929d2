"""An SSE session's messages may reach any worker process: the one holding the stream gets
them through Redis (doors/mcp/sse_relay.py). Two apps of their own (as two worker
processes have), the stream on one, every message POSTed to the other."""

from __future__ import annotations

import json
import re

import httpx
import pytest

pytestmark = [pytest.mark.redis, pytest.mark.django_db(transaction=True)]
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "relay-test", "version": "1"},
    },
}


def test_a_message_posted_to_another_process_reaches_the_stream(start_asgi_server):
    holder, other = start_asgi_server(), start_asgi_server()
    with (
        httpx.Client(timeout=20) as http,
        http.stream("GET", f"{holder}/mcp/sse") as stream,
    ):
        lines = stream.iter_lines()
        endpoint = next(line for line in lines if line.startswith("data: "))[6:]
        assert re.fullmatch(r"/mcp/messages/\?session_id=[0-9a-f]{32}", endpoint)
        posted = http.post(f"{other}{endpoint}", json=INITIALIZE)
        assert posted.status_code == 202, posted.text
        answer = next(line for line in lines if line.startswith("data: "))
        reply = json.loads(answer[6:])
        assert reply["id"] == 1 and reply["result"]["serverInfo"]["name"] == "tollbooth"
    # A session nobody holds is unknown, as the SDK answers it.
    gone = httpx.post(f"{other}/mcp/messages/?session_id={'0' * 32}", json=INITIALIZE)
    assert gone.status_code == 404
