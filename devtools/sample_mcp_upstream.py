"""A seller's MCP server for tests and the demo: one tool, `count`, with a real side effect
(a row in its own SQLite file) keyed by the purchase key Tollbooth sends in `_meta`.

    python -m devtools.sample_mcp_upstream --db /tmp/mcp.sqlite3 [--port 0]

Prints "sample mcp upstream listening on <port>"; the MCP endpoint is /mcp, and GET /stats
answers {"effects": n, "calls": n}. Input "sleep": seconds to wait after the effect.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sqlite3
from typing import Any

import uvicorn
from mcp.server.fastmcp import Context, FastMCP
from starlette.requests import Request
from starlette.responses import JSONResponse


def build(db_path: str) -> FastMCP:
    db = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
    db.execute("CREATE TABLE IF NOT EXISTS effects (key TEXT PRIMARY KEY, n INT)")
    calls = {"n": 0}
    server = FastMCP("sample-upstream", stateless_http=True, json_response=True)

    @server.tool()
    async def count(text: str, ctx: Context, sleep: float = 0.0) -> dict[str, Any]:  # type: ignore[type-arg]
        """Counts one effect per purchase key."""
        calls["n"] += 1
        meta = ctx.request_context.meta
        key = str(getattr(meta, "tollbooth/idempotency_key", "") or "") if meta else ""
        row = db.execute("SELECT n FROM effects WHERE key=?", (key,)).fetchone()
        if row is None:
            number = db.execute("SELECT count(*) FROM effects").fetchone()[0] + 1
            db.execute("INSERT INTO effects VALUES (?, ?)", (key, number))
            row = (number,)
        if sleep:
            await asyncio.sleep(sleep)
        return {"key": key, "effect": row[0], "text": text.upper()}

    @server.custom_route("/stats", methods=["GET"])
    async def stats(request: Request) -> JSONResponse:
        effects = db.execute("SELECT count(*) FROM effects").fetchone()[0]
        return JSONResponse({"effects": effects, "calls": calls["n"]})

    return server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    sock = socket.socket()
    sock.bind(("127.0.0.1", args.port))
    sock.listen(64)  # connections queue from now on, before the server loop accepts them
    print(f"sample mcp upstream listening on {sock.getsockname()[1]}", flush=True)
    app = build(args.db).streamable_http_app()
    config = uvicorn.Config(app, log_level="warning")
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    main()
