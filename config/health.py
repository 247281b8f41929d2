"""Liveness (`/healthz`) and readiness (`/readyz`) for load balancers and orchestrators.

Answered by a middleware that sits first, before host validation and the HTTPS redirect: a
probe comes from the load balancer by pod or host address over plain HTTP, and must get the
truth, not a 400 for its Host header or a 301 to https. Nothing else runs for these paths
(no session, no throttle, no authentication) and every answer is `no-store`.

- `/healthz`: the process is up and serving. No I/O at all, so a slow database never gets a
  healthy process restarted.
- `/readyz`: the database, the broker, each configured x402 network's RPC (both URLs when
  X402_<NET>_RPC_URL_FALLBACK is set: `rpc:<network>` and `rpc_fallback:<network>`; one
  of the two failing is degraded, both failing is unavailable), a direct-mode network's
  relayer gas as beat last read it (low: degraded) and, for a network settled through a
  facilitator, that facilitator (`GET /supported`, called with the network's facilitator
  credentials, so a refused key shows here) answer, each
  within CHECK_TIMEOUT_SECONDS; all checks run at once, so the probe takes at most about
  that long. 200 when every check passes, 503 otherwise; except the broker, whose failure
  is reported (`"status": "degraded"`, still 200): the API serves without it (the outbox
  keeps the jobs, throttling counts in process memory), and every replica shares the one
  broker, so taking them out of rotation would turn a Redis outage into a full one. So is
  a direct-mode relayer low on gas (`relayer_gas:<network>`, from beat's last reading, no
  RPC: payments/rails/x402/gas.py): only new payments on that network are refused, and
  every replica shares the one relayer. A reading never made, or too old, is `"gas":
  "unknown"` and passes. So is a facilitator that does not answer or refuses our
  credentials (`facilitator:<network>`): every replica calls the same one, paid requests
  on that network answer 503 + Retry-After with nothing recorded, and prepaid purchases,
  status URLs, paid results and the admin go on. Each
  check reports `ok` and its latency; a failure names only the error's type (a message
  could carry a host or an RPC key). A result is reused for
  TOLLBOOTH_READINESS_CACHE_SECONDS, so a flood of probes cannot turn into a flood of RPC
  calls on a metered provider.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import requests
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections
from django.http import HttpRequest, HttpResponse

from core.middleware import BothModesMiddleware
from payments.rails.x402.facilitator import (
    REFUSAL_STATUSES,
    FacilitatorRefused,
    facilitator_name,
)
from payments.rails.x402.networks import network_facilitator

CHECK_TIMEOUT_SECONDS = 2.0
LIVENESS_PATH = "/healthz"
READINESS_PATH = "/readyz"

CheckResult = dict[str, Any]
# Checks whose failure degrades the service but must not take a replica out of rotation.
DEGRADING_CHECKS = frozenset({"broker"})
# The same, by prefix: a relayer low on gas, or a facilitator down or refusing our key, refuses
# new payments on its network only (503 per request, nothing recorded); every other answer,
# status URL and redelivery still works, and every replica shares the one relayer or
# facilitator: out of rotation, a facilitator outage would become a full one.
DEGRADING_PREFIXES = ("relayer_gas:", "facilitator:")

_cache_lock = threading.Lock()
_cached: tuple[float, int, dict[str, Any]] | None = None


def _check_database() -> None:
    connection = connections["default"]
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    finally:
        # The check runs in its own thread: its connection must not outlive it.
        connection.close()


def _check_broker() -> None:
    from config.celery_app import app

    # Kombu's Redis channel pings on open; max_retries=0 gives up at the first failure.
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=0, timeout=CHECK_TIMEOUT_SECONDS)


def _rpc_check(rpc_url: str, chain_id: int) -> Callable[[], None]:
    def check() -> None:
        answer = requests.post(
            rpc_url,
            json={"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []},
            timeout=CHECK_TIMEOUT_SECONDS,
        )
        answer.raise_for_status()
        if int(answer.json()["result"], 16) != chain_id:
            raise WrongChain  # the URL points at another chain than the one we settle on

    return check


class WrongChain(Exception):
    pass


class RelayerGasLow(Exception):
    pass


class RelayerGasEmpty(Exception):
    pass


def _relayer_gas_check(caip2: str) -> Callable[[], CheckResult | None]:
    """The relayer's gas as beat last read it (no RPC): below its alert threshold fails
    (`RelayerGasLow`), too little for one settlement too (`RelayerGasEmpty`); never read, or
    read too long ago, passes as `"gas": "unknown"` (unknown refuses no payment either)."""

    def check() -> CheckResult | None:
        from django.utils import timezone

        from payments.rails.x402.gas import relayer_gas_status

        try:
            status = relayer_gas_status(caip2, now=timezone.now())
        finally:
            connections["default"].close()  # its own thread: the connection goes with it
        if status == "low":
            raise RelayerGasLow
        if status == "empty":
            raise RelayerGasEmpty
        return {"gas": status}

    return check


def _facilitator_check(caip2: str, raw: dict[str, Any]) -> Callable[[], None]:
    """A facilitator that settles for us answers its discovery endpoint (`GET /supported`)
    with our credentials (a fresh JWT for a CDP key): a revoked key fails here, naming
    `FacilitatorRefused`, before a buyer's payment meets it."""

    def check() -> None:
        url, auth = network_facilitator(caip2, raw)  # unusable credentials: not ready
        supported = f"{url.rstrip('/')}/supported"
        headers = auth.headers("GET", supported) if auth is not None else {}
        answer = requests.get(
            supported, headers=headers, timeout=CHECK_TIMEOUT_SECONDS, allow_redirects=False
        )
        if answer.status_code in REFUSAL_STATUSES:
            raise FacilitatorRefused(
                network=caip2,
                facilitator=facilitator_name(url),
                endpoint="supported",
                status=answer.status_code,
            )
        answer.raise_for_status()

    return check


def _configured_networks() -> dict[str, dict[str, Any]]:
    """Networks we can settle on: a token and a way to settle (relayer key or facilitator:
    the network's own, or the global one)."""
    from payments.signers import relayer_address

    facilitator = bool(settings.X402_FACILITATOR_URL)
    return {
        caip2: raw
        for caip2, raw in settings.X402_NETWORKS.items()
        if raw.get("token_address")
        and (
            relayer_address(network=caip2) is not None
            if raw.get("mode") == "direct"
            else raw.get("facilitator_url") or facilitator
        )
    }


def readiness_checks() -> dict[str, Callable[[], CheckResult | None]]:
    checks: dict[str, Callable[[], CheckResult | None]] = {
        "database": _check_database,
        "broker": _check_broker,
    }
    for caip2, raw in _configured_networks().items():
        checks[f"rpc:{caip2}"] = _rpc_check(raw["rpc_url"], int(raw["chain_id"]))
        if raw.get("rpc_url_fallback"):
            checks[f"rpc_fallback:{caip2}"] = _rpc_check(
                raw["rpc_url_fallback"], int(raw["chain_id"])
            )
        if raw.get("mode") == "direct":
            checks[f"relayer_gas:{caip2}"] = _relayer_gas_check(caip2)
        else:
            checks[f"facilitator:{caip2}"] = _facilitator_check(caip2, raw)
    return checks


def _run(checks: dict[str, Callable[[], CheckResult | None]]) -> dict[str, CheckResult]:
    results: dict[str, CheckResult] = {}

    def run_one(name: str, check: Callable[[], CheckResult | None]) -> None:
        started = time.monotonic()
        try:
            said = check()
            outcome: CheckResult = {"ok": True, **(said if isinstance(said, dict) else {})}
        except Exception as exc:  # any failure is "not ready", never a 500
            outcome = {"ok": False, "error": type(exc).__name__}
        outcome["ms"] = round((time.monotonic() - started) * 1000, 1)
        results[name] = outcome

    threads = {
        name: threading.Thread(target=run_one, args=(name, check), daemon=True)
        for name, check in checks.items()
    }
    for thread in threads.values():
        thread.start()
    deadline = time.monotonic() + CHECK_TIMEOUT_SECONDS + 0.5
    for thread in threads.values():
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    for name in checks:
        # A check stuck past its timeout (a connect that ignores it) is a failure; its
        # daemon thread is abandoned and ends with its socket.
        results.setdefault(name, {"ok": False, "error": "Timeout", "ms": None})
    return {name: results[name] for name in checks}


def readiness() -> tuple[int, dict[str, Any]]:
    """(status, body) of the readiness probe, reused for the configured cache time."""
    global _cached
    ttl = float(getattr(settings, "TOLLBOOTH_READINESS_CACHE_SECONDS", 0.0))
    with _cache_lock:  # concurrent probes wait for one run instead of each doing I/O
        now = time.monotonic()
        if _cached is not None and now - _cached[0] < ttl:
            return _cached[1], _cached[2]
        results = _run(readiness_checks())
        failed = {name for name, result in results.items() if not result["ok"]}
        ready = all(_degrades_only(name, failed, results) for name in failed)
        label = "unavailable" if not ready else "degraded" if failed else "ready"
        body = {"status": label, "checks": results}
        status = 200 if ready else 503
        _cached = (time.monotonic(), status, body)
        return status, body


def _degrades_only(check: str, failed: set[str], results: dict[str, CheckResult]) -> bool:
    """Whether a failed check leaves the replica serving: the broker, a relayer low on gas,
    a facilitator, or one of a network's two RPC URLs while the other answers (the client
    fails over)."""
    if check in DEGRADING_CHECKS or check.startswith(DEGRADING_PREFIXES):
        return True
    for mine, other in (("rpc:", "rpc_fallback:"), ("rpc_fallback:", "rpc:")):
        if check.startswith(mine):
            twin = other + check.removeprefix(mine)
            return twin in results and twin not in failed
    return False


def _answer(status: int, body: dict[str, Any], *, head: bool = False) -> HttpResponse:
    content = b"" if head else json.dumps(body).encode()
    response = HttpResponse(content, status=status, content_type="application/json")
    response["Cache-Control"] = "no-store"
    response["Content-Length"] = str(len(json.dumps(body).encode()) if head else len(content))
    return response


class HealthCheckMiddleware(BothModesMiddleware):
    """Answer the probes before anything else runs (see the module docstring)."""

    def answer(self, request: HttpRequest) -> HttpResponse | None:
        early = _early_answer(request)
        if early is not None or request.path_info != READINESS_PATH:
            return early
        status, body = readiness()
        return _answer(status, body, head=request.method == "HEAD")

    async def answer_async(self, request: HttpRequest) -> HttpResponse | None:
        early = _early_answer(request)
        if early is not None or request.path_info != READINESS_PATH:
            return early
        # The checks wait on the network: off the event loop.
        status, body = await sync_to_async(readiness, thread_sensitive=False)()
        return _answer(status, body, head=request.method == "HEAD")


def _early_answer(request: HttpRequest) -> HttpResponse | None:
    """Not a probe (None, go on), or a probe answered without any I/O: a wrong method, or
    liveness. Readiness is left to the caller (it waits on the checks)."""
    path = request.path_info
    if path not in (LIVENESS_PATH, READINESS_PATH):
        return None
    if request.method not in ("GET", "HEAD"):
        response = _answer(405, {"status": "method_not_allowed"})
        response["Allow"] = "GET, HEAD"
        return response
    if path == LIVENESS_PATH:
        return _answer(200, {"status": "alive"}, head=request.method == "HEAD")
    return None
