"""Liveness and readiness probes (config/health.py): answered before host checks, without
I/O for liveness, each readiness check bounded and reported, never a trace."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from typing import Any

import pytest
from django.test import Client

import config.health as health
from tests.x402.e2e import NETWORK


@pytest.fixture(autouse=True)
def _no_readiness_cache(settings: Any) -> None:
    settings.TOLLBOOTH_READINESS_CACHE_SECONDS = 0


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # nothing listens once the socket closes


def _network(settings: Any, rpc_url: str) -> None:
    local = settings.X402_NETWORKS[NETWORK]
    settings.X402_NETWORKS = {
        NETWORK: {
            **local,
            "rpc_url": rpc_url,
            "token_address": "0x" + "1" * 40,
            "mode": "direct",
            "relayer_private_key": "0x" + "2" * 64,
        },
    }


def test_liveness_does_no_io_and_ignores_the_host_header():
    # No database access is allowed in this test: a query would fail it.
    answer = Client().get("/healthz", HTTP_HOST="10.0.0.7")  # a probe by pod address
    assert answer.status_code == 200 and answer.json() == {"status": "alive"}
    assert answer["Cache-Control"] == "no-store"


@pytest.mark.django_db(transaction=True)
def test_readiness_reports_each_check_with_its_latency(settings):
    settings.X402_NETWORKS = {}
    answer = Client().get("/readyz", HTTP_HOST="10.0.0.7")
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert body["status"] == "ready" and set(body["checks"]) == {"database", "broker"}
    for check in body["checks"].values():
        assert check["ok"] is True and check["ms"] >= 0
    assert answer["Cache-Control"] == "no-store"


@pytest.mark.django_db(transaction=True)
def test_an_unreachable_rpc_is_503_naming_only_the_error_type(settings):
    _network(settings, f"http://127.0.0.1:{_closed_port()}/secret-provider-key")
    answer = Client().get("/readyz")
    assert answer.status_code == 503
    body = answer.json()
    assert body["status"] == "unavailable"
    assert body["checks"][f"rpc:{NETWORK}"] == {
        "ok": False,
        "error": "ConnectionError",
        "ms": body["checks"][f"rpc:{NETWORK}"]["ms"],
    }
    assert body["checks"]["database"]["ok"] is True
    assert "secret-provider-key" not in answer.content.decode()
    assert "Traceback" not in answer.content.decode()


class _Supported(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        code = self.status if self.path.endswith("/supported") else 404
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"kinds": []}')

    def do_POST(self) -> None:
        """An RPC that knows only its chain id: `eth_chainId` of the local network."""
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        body = {"jsonrpc": "2.0", "id": request["id"], "result": hex(31337)}
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def facilitator_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Supported)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/some-path"
    server.shutdown()
    server.server_close()


def _facilitated(settings: Any, facilitator: str) -> None:
    local = settings.X402_NETWORKS[NETWORK]
    settings.X402_FACILITATOR_URL = ""
    settings.X402_NETWORKS = {
        NETWORK: {
            **local,
            "token_address": "0x" + "1" * 40,
            "mode": "facilitator",
            "facilitator_url": facilitator,
        },
    }


def test_a_network_settled_through_a_facilitator_checks_that_facilitator(settings, facilitator_url):
    _facilitated(settings, facilitator_url)
    checks = health.readiness_checks()
    assert set(checks) == {"database", "broker", f"rpc:{NETWORK}", f"facilitator:{NETWORK}"}
    checks[f"facilitator:{NETWORK}"]()  # answers /supported: ready

    _Supported.status = 503
    try:
        with pytest.raises(Exception, match="503"):
            checks[f"facilitator:{NETWORK}"]()
    finally:
        _Supported.status = 200


@pytest.mark.django_db(transaction=True)
def test_an_unreachable_facilitator_degrades_naming_only_the_error_type(settings, facilitator_url):
    """Every replica calls the same facilitator: taking them all out of rotation would stop
    prepaid purchases, status URLs and paid results too. Its paid requests answer 503."""
    _facilitated(settings, f"http://127.0.0.1:{_closed_port()}/secret-facilitator-key")
    rpc = facilitator_url  # the same little server answers eth_chainId
    settings.X402_NETWORKS[NETWORK]["rpc_url"] = rpc
    answer = Client().get("/readyz")
    assert (answer.status_code, answer.json()["status"]) == (200, "degraded"), answer.json()
    check = answer.json()["checks"][f"facilitator:{NETWORK}"]
    assert (check["ok"], check["error"]) == (False, "ConnectionError")
    assert "secret-facilitator-key" not in answer.content.decode()


def test_networks_without_a_way_to_settle_are_not_checked(settings):
    settings.X402_FACILITATOR_URL = ""
    local = settings.X402_NETWORKS[NETWORK]
    settings.X402_NETWORKS = {NETWORK: {**local, "token_address": "", "relayer_private_key": ""}}
    assert set(health.readiness_checks()) == {"database", "broker"}


def test_a_hung_check_fails_within_the_timeout(monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(health, "CHECK_TIMEOUT_SECONDS", 0.2)
    monkeypatch.setattr(health, "readiness_checks", lambda: {"hung": lambda: release.wait(30)})
    started = time.monotonic()
    try:
        answer = Client().get("/readyz")
    finally:
        release.set()
    assert time.monotonic() - started < 5
    assert answer.status_code == 503
    assert answer.json()["checks"]["hung"] == {"ok": False, "error": "Timeout", "ms": None}


def test_a_result_is_reused_for_the_cache_time(settings, monkeypatch):
    settings.TOLLBOOTH_READINESS_CACHE_SECONDS = 60
    monkeypatch.setattr(health, "_cached", None)
    runs: list[int] = []
    monkeypatch.setattr(health, "readiness_checks", lambda: {"counted": lambda: runs.append(1)})
    for _ in range(3):
        assert Client().get("/readyz").status_code == 200
    assert runs == [1]


def test_only_get_and_head():
    assert Client().post("/healthz").status_code == 405
    head = Client().head("/healthz")
    assert head.status_code == 200 and head.content == b""
