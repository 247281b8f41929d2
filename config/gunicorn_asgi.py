"""gunicorn for the ASGI app (config/asgi.py): `gunicorn -c python:config.gunicorn_asgi`.

The MCP door (`/mcp`, docs/mcp.md) holds long-lived connections: an SSE stream per client,
and a tool call that waits for its settlement and work. Under uvicorn workers each costs a
coroutine (and, while its synchronous domain call runs, one of TOLLBOOTH_MCP_THREADS, or of
TOLLBOOTH_X402_THREADS for a call paid over x402, whose wait for its block holds none), not a
gthread worker thread. The load balancer routes `/mcp` here and everything else to
config/gunicorn.py; this app also serves the whole site, so one port is enough for a small
install. Values shared with config/gunicorn.py (timeout, graceful timeout, keep-alive,
recycling, logging) come from there and its environment variables; besides:

| variable | default | why |
|---|---|---|
| GUNICORN_ASGI_BIND | 0.0.0.0:8001 | beside the WSGI port, one per replica |
| GUNICORN_ASGI_WORKERS | the CPU count | one event loop per core |
"""

from __future__ import annotations

import os

# Before config.gunicorn reads the settings: this role's site is config.urls_asgi (the x402
# paid URL waits for its block on the event loop), as config/asgi.py says.
os.environ.setdefault("TOLLBOOTH_ROOT_URLCONF", "config.urls_asgi")

from config.gunicorn import (  # noqa: F401  (gunicorn reads these names from this module)
    access_log_format,
    accesslog,
    backlog,
    control_socket_disable,
    errorlog,
    graceful_timeout,
    keepalive,
    logger_class,
    loglevel,
    max_requests,
    max_requests_jitter,
    preload_app,
    timeout,
    worker_tmp_dir,
)

wsgi_app = "config.asgi:application"
worker_class = "config.uvicorn_worker.TollboothUvicornWorker"
bind = [os.environ.get("GUNICORN_ASGI_BIND", "0.0.0.0:8001")]
workers = int(os.environ.get("GUNICORN_ASGI_WORKERS", str(os.cpu_count() or 2)))
proc_name = "tollbooth-asgi"
