"""The demo's one address, routed by path as production's load balancer routes it.

Production's balancer (docs/deployment.md; the HAProxy configuration `make bench-hosts` runs,
bench/hosts_net.py, builds its ACLs from the rule below) sends the x402 paid URLs
`/x402/<offering>` and `/x402/<offering>/<rest>` (an API sold as a path prefix) and the
MCP door (`/mcp`, `/mcp/...`) to the ASGI role, where a payment waiting for its block costs
a coroutine, not a thread, and everything else (the agent API, the admin, the status URLs
under `/x402/purchases/`, health) to the WSGI role. `make demo` runs both roles; this
process sits on the address the banner prints and does the same, so the demo's paid URLs
are served where production serves them. A reverse proxy in Python (aiohttp, already
pinned for the x402 SDK) rather than HAProxy: the demo needs no service installed by hand.

    python -m devtools.demo_router --listen 127.0.0.1:8000 \
        --wsgi http://127.0.0.1:8002 --asgi http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys

import aiohttp
from aiohttp import web

# The rule, in HAProxy's terms (path_reg is PCRE; these patterns mean the same in Python).
PAID_URL_REGEX = r"^/x402/[^/]+(/.*)?$"
STATUS_URL_PREFIX = "/x402/purchases/"
MCP_PATH = "/mcp"
_PAID_URL = re.compile(PAID_URL_REGEX)

# Hop-by-hop headers (RFC 9110 7.6.1) are the proxy's own on each side, never relayed.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


def routes_to_asgi(path: str) -> bool:
    """True for the paths production's balancer sends to the ASGI role."""
    if path == MCP_PATH or path.startswith(MCP_PATH + "/"):
        return True
    return bool(_PAID_URL.match(path)) and not path.startswith(STATUS_URL_PREFIX)


def haproxy_acls() -> str:
    """The same rule as HAProxy ACLs, for the production shape bench/hosts_net.py builds."""
    return (
        f"    acl paid_url path_reg {PAID_URL_REGEX}\n"
        f"    acl status_url path_beg {STATUS_URL_PREFIX}\n"
        f"    acl mcp path {MCP_PATH}\n"
        f"    acl mcp path_beg {MCP_PATH}/\n"
        "    use_backend asgi if paid_url !status_url or mcp"
    )


def build_app(wsgi: str, asgi: str) -> web.Application:
    """The aiohttp application relaying every request to its role, answers streamed back
    as they come (MCP's SSE stream included)."""
    session: dict[str, aiohttp.ClientSession] = {}

    async def open_session(app: web.Application) -> None:
        # No total timeout: a paid request waits for its block, an SSE stream stays open;
        # gunicorn's own timeout bounds the first. Idle pooled connections are dropped well
        # before the roles' keep-alive (75 s), so a reused one is never half-closed.
        session["client"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=15),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False,
        )

    async def close_session(app: web.Application) -> None:
        await session["client"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        backend = asgi if routes_to_asgi(request.path) else wsgi
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers.pop("Content-Length", None)  # aiohttp sets it from the body it sends
        peer = request.remote or ""
        forwarded = request.headers.get("X-Forwarded-For")
        # As HAProxy's `option forwardfor`: the demo trusts one proxy (TOLLBOOTH_TRUSTED_PROXIES).
        headers["X-Forwarded-For"] = f"{forwarded}, {peer}" if forwarded else peer
        body = await request.read() if request.body_exists else None
        try:
            upstream = await session["client"].request(
                request.method,
                backend + request.raw_path,
                headers=headers,
                data=body,
                allow_redirects=False,
            )
        except (aiohttp.ClientError, OSError) as error:
            # The role is down (restarting after `demo.py kill web`): as a balancer answers.
            return web.Response(
                status=502,
                text=f"demo router: {backend} did not answer: {type(error).__name__}\n",
                headers={"Retry-After": "1"},
            )
        async with upstream:
            answer = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in HOP_BY_HOP:
                    answer.headers.add(name, value)
            await answer.prepare(request)
            async for chunk in upstream.content.iter_any():
                await answer.write(chunk)
            await answer.write_eof()
        return answer

    app = web.Application(client_max_size=1024**3)  # the roles enforce their own limits
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT the banner prints")
    parser.add_argument("--wsgi", required=True, help="the WSGI role's base URL")
    parser.add_argument("--asgi", required=True, help="the ASGI role's base URL")
    args = parser.parse_args(argv)
    loop: asyncio.AbstractEventLoop
    try:
        import uvloop  # as the ASGI role runs (config/uvicorn_worker.py)

        loop = uvloop.new_event_loop()
    except ImportError:  # only slower without it
        loop = asyncio.new_event_loop()
    host, _, port = args.listen.rpartition(":")
    print(
        f"demo router on {args.listen}: paid URLs and /mcp to {args.asgi}, the rest to {args.wsgi}",
        flush=True,
    )
    web.run_app(
        build_app(args.wsgi.rstrip("/"), args.asgi.rstrip("/")),
        host=host,
        port=int(port),
        print=None,
        access_log=None,
        backlog=2048,
        loop=loop,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
