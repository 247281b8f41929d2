"""The ASGI entry point: the MCP door (`/mcp`, doors.mcp) beside the Django app.

Production serves it with uvicorn workers under gunicorn (config/gunicorn_asgi.py), where
MCP's long-lived connections (SSE, a tool call waiting for its settlement and work) cost a
coroutine, not a sync worker. The Django app here routes by config.urls_asgi: the x402 paid
URL waits for its block on the event loop, not in a thread (doors/x402/paid_async.py);
the load balancer sends it and `/mcp` here, the rest of the site to WSGI gunicorn
(config/gunicorn.py). See docs/deployment.md and docs/mcp.md. Production unless told
otherwise, as config/wsgi.py.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")
os.environ.setdefault("TOLLBOOTH_ROOT_URLCONF", "config.urls_asgi")

from django.core.asgi import get_asgi_application
from django.core.handlers.asgi import ASGIHandler
from django.core.signals import request_finished
from django.db import connections

django_application = get_asgi_application()


def request_connections_close(**_: Any) -> None:
    """Close the database connections of the request's own thread at its end.

    Under ASGI, Django runs each request's synchronous code (sync views and middleware) on
    a thread of that request's own (asgiref's ThreadSensitiveContext), gone once it answers.
    A persistent connection (CONN_MAX_AGE > 0) opened there is never reused, and Django's
    `close_old_connections` at the request's end keeps it: it lingered, idle, until its
    thread was garbage-collected, and under load they piled up towards PostgreSQL's
    max_connections (tests/integration/test_asgi_connections.py). Django's documentation
    says to disable persistent connections under ASGI; here that holds for these
    per-request threads only. The long-lived bounded pools (the paid URL's
    TOLLBOOTH_X402_THREADS, MCP's TOLLBOOTH_MCP_THREADS) check their connection out and back
    in around each call with `close_old_connections` and keep it as CONN_MAX_AGE says
    (health-checked): a bounded number, reused. `request_finished` fires on the request's
    thread (Django closes the response there), and only the ASGI handler's is taken: the
    WSGI role and the test client keep Django's behaviour."""
    connections.close_all()


request_finished.connect(
    request_connections_close, sender=ASGIHandler, dispatch_uid="asgi_request_connections_close"
)

from doors.mcp.server import McpApp  # noqa: E402  (needs the apps loaded)
from doors.x402.paid_async import served_on_event_loop  # noqa: E402


def build_application() -> Any:
    """A fresh app: `/mcp...` to the MCP server, everything else to Django; the lifespan
    runs the MCP session manager (each app runs it once)."""
    mcp_app = McpApp()

    async def application(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(mcp_app, receive, send)
        elif scope["type"] == "http" and McpApp.handles(scope["path"]):
            await mcp_app(scope, receive, send)
        else:
            with served_on_event_loop():
                await django_application(scope, receive, send)

    return application


async def _lifespan(mcp_app: McpApp, receive: Any, send: Any) -> None:
    async with mcp_app.lifespan():
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


application = build_application()
