"""gunicorn's configuration: `gunicorn -c python:config.gunicorn` (docs/deployment.md).

Threaded workers (gthread): a paid x402 request spends most of its time waiting on the
chain and on the worker's result, not on the CPU, so threads keep a process busy while
those waits run, and a waiting request does not stop the process from answering its
heartbeat. Every value can be overridden from the environment:

| variable | default | why |
|---|---|---|
| GUNICORN_BIND | 0.0.0.0:8000 | one port per replica; the load balancer spreads requests |
| GUNICORN_WORKERS | the CPU count (2 on the reference box) | one process per core: the GIL |
| GUNICORN_THREADS | 8 | requests waiting on I/O per process; each holds a DB connection |
| GUNICORN_TIMEOUT | the longest paid wait + 30 s | never cut off a request still inside it |
| GUNICORN_GRACEFUL_TIMEOUT | = timeout | a deploy lets in-flight paid requests finish |
| GUNICORN_KEEPALIVE | 75 | above common load balancer idle timeouts (60 s): no 502 races |
| GUNICORN_MAX_REQUESTS | 2000 (+ up to 200 jitter) | recycle workers so a slow leak stays bounded |
"""

from __future__ import annotations

import os
import re
from typing import Any

from gunicorn.glogging import Logger

# As config/wsgi.py: production unless told otherwise (the demo says local).
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")
wsgi_app = "config.wsgi:application"
_env = os.environ.get


def longest_paid_wait_seconds() -> float:
    """The longest a paid request can legitimately take: the slowest configured network's
    confirmation wait, the result wait, and an RPC or facilitator call on either side."""
    from django.conf import settings

    networks = settings.X402_NETWORKS.values()
    confirmation = max((float(n["confirmation_timeout"]) for n in networks), default=0.0)
    calls = 2 * max(5.0, float(settings.X402_FACILITATOR_TIMEOUT))
    return confirmation + float(settings.X402_RESULT_WAIT_SECONDS) + calls


bind = [_env("GUNICORN_BIND", "0.0.0.0:8000")]
worker_class = "gthread"
workers = int(_env("GUNICORN_WORKERS", str(os.cpu_count() or 2)))
threads = int(_env("GUNICORN_THREADS", "8"))
timeout = int(_env("GUNICORN_TIMEOUT", str(int(longest_paid_wait_seconds()) + 30)))
graceful_timeout = int(_env("GUNICORN_GRACEFUL_TIMEOUT", str(timeout)))
keepalive = int(_env("GUNICORN_KEEPALIVE", "75"))
max_requests = int(_env("GUNICORN_MAX_REQUESTS", "2000"))
max_requests_jitter = max_requests // 10
# Queued connections while every thread is busy: a burst of agents waits, not resets.
backlog = 2048
# Each worker imports the app after the fork: no database connection is ever shared.
preload_app = False
# The heartbeat file on tmpfs: a slow container disk must not get a healthy worker killed.
worker_tmp_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None  # noqa: S108
# gunicorn 27's control socket defaults to one path per user: two replicas on one host
# (or the demo beside them) would fight over it, and nothing here uses it.
control_socket_disable = True
proc_name = "tollbooth-web"

accesslog = _env("GUNICORN_ACCESS_LOG", "-")
errorlog = "-"
loglevel = _env("LOG_LEVEL", "info").lower()
# Who, what, the answer, its size, and the time taken in microseconds, per request.
access_log_format = '%(h)s "%(r)s" %(s)s %(B)s %(D)sus "%(a)s"'

# A purchase's capability status URL carries its secret in the path: keep it out of logs.
_CAPABILITY = re.compile(r"(/x402/purchases/[^/\s?]+/)[^\s?]+")


class RedactingLogger(Logger):
    """The access log without capability tokens."""

    def atoms(self, resp: Any, req: Any, environ: Any, request_time: Any) -> dict[str, Any]:
        atoms: dict[str, Any] = super().atoms(resp, req, environ, request_time)
        for key in ("r", "U"):
            if isinstance(atoms.get(key), str):
                atoms[key] = _CAPABILITY.sub(r"\1[redacted]", atoms[key])
        return atoms


logger_class = RedactingLogger
