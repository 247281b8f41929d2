"""The ASGI role (config/gunicorn_asgi.py: uvicorn workers, production settings) does not
pile up database connections.

Under ASGI, Django runs each request's synchronous code (sync views, sync middleware) on a
thread of its own (asgiref's ThreadSensitiveContext, one per request). A persistent
connection (CONN_MAX_AGE > 0) opened there is never reused by a later request, and
`close_old_connections` at the request's end keeps it: it lingers, idle, until the thread
and its connection are garbage-collected. Measured here before the fix: 53 idle backends
left after 1,200 requests (75 at the peak of 64 concurrent clients, against PostgreSQL's
default `max_connections` of 100); this test saw 42 after its first 600. The role now
closes the connections of each request's own thread at its end (config/asgi.py,
`request_connections_close`); the paid URL's bounded pool keeps one per thread.

A real gunicorn with two uvicorn workers on the test database; the backends are counted
in pg_stat_activity. Nothing here is timed.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from django.db import connection

from tests.x402.e2e import build_world

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
REQUESTS = 600
CLIENTS = 32
WORKERS = 2  # start_replica's GUNICORN_ASGI_WORKERS
PAID_THREADS = 2  # the paid URL's pool per worker: each thread keeps its connection
# What the role keeps on purpose, per worker: its paid pool's connections and the result
# waits' listener. Not one per request served.
KEPT = WORKERS * (PAID_THREADS + 1)
BOOTED_WITHIN = 60.0  # seconds for a worker to finish booting on a loaded machine


def _chain_env(world, anvil_node) -> dict[str, str]:
    return {
        "X402_LOCAL_RPC_URL": anvil_node.rpc_url,
        "X402_LOCAL_TOKEN": world.token,
        "X402_LOCAL_RELAYER_KEY": world.relayer.key.hex(),
        "X402_LOCAL_MODE": "direct",
    }


def _backends() -> int:
    """Connections to the test database other than this test's own."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return int(cursor.fetchone()[0])


def test_the_asgi_role_leaves_no_connections_behind_its_sync_views(
    settings, start_replica, anvil_node
):
    world = build_world(settings, anvil_node)
    replica = start_replica(
        {**_chain_env(world, anvil_node), "TOLLBOOTH_X402_THREADS": str(PAID_THREADS)},
        asgi=True,
    )
    before = _backends()
    # Sync views that read the database (discovery, readiness) and the paid URL's 402.
    paths = ["/.well-known/x402", "/readyz", world.paid_url]

    def call(i: int) -> int:
        path = paths[i % len(paths)]
        if path == world.paid_url:
            data = {"title": f"asgi {i}", "csv": "a\n1\n"}
            return requests.post(replica.url + path, json=data, timeout=60).status_code
        return requests.get(replica.url + path, timeout=60).status_code

    for _ in range(2):  # a second round finds the same connections, no more
        with ThreadPoolExecutor(CLIENTS) as clients:
            codes = list(clients.map(call, range(REQUESTS)))
        assert set(codes) <= {200, 402}, sorted(set(codes))
        left = _backends() - before
        assert left <= KEPT, f"{left} connections left after {REQUESTS} requests"


def test_the_asgi_roles_workers_serve_on_uvloop_with_httptools(settings, start_replica, anvil_node):
    """config/uvicorn_worker.py: uvicorn's "auto" would fall back to asyncio's loop and h11
    without a word (a fifth more CPU per paid call at 64 agents, docs/benchmarks.md). Each
    worker, once booted, has uvloop's loop and httptools' parser mapped into its memory. A
    worker may still be booting when the replica first answers (its sibling took the
    requests), so each is given until BOOTED_WITHIN; one on the fallback never maps them."""
    world = build_world(settings, anvil_node)
    replica = start_replica(_chain_env(world, anvil_node), asgi=True)
    pids = re.findall(r"Booting worker with pid: (\d+)", replica.log())
    assert len(pids) == WORKERS, replica.log()
    needed = {"/uvloop/loop.": "uvloop", "/httptools/parser/parser.": "httptools"}
    missing: dict[str, list[str]] = {}
    deadline = time.monotonic() + BOOTED_WITHIN
    while True:
        assert requests.get(replica.url + "/.well-known/x402", timeout=30).status_code == 200
        maps = {pid: Path(f"/proc/{pid}/maps").read_text() for pid in pids}
        missing = {
            pid: [name for path, name in needed.items() if path not in mapped]
            for pid, mapped in maps.items()
        }
        if not any(missing.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not any(missing.values()), f"workers without them: {missing}"
