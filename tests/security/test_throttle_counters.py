"""The throttle counters on real Redis: one round trip per request for both scopes, exact
limits under concurrent requests, an exact Retry-After, and what a Redis outage answers."""

from __future__ import annotations

import contextvars
import os
import threading
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from django.core.cache import caches
from django.core.cache.backends.redis import RedisCache
from django.db import connection
from rest_framework.test import APIClient

from core import rate_limit
from core.rate_limit import Window, rate_limit_hit
from doors.rest.throttles import PaidRequestThrottle
from purchases.models import Quote
from purchases.services.shared.buyers import api_key_issue
from tests.conftest import CSV_INPUT
from tests.security.test_throttling import assert_throttled, rates

T0 = 1_800_000_000.0  # an injected clock: no test here reads the wall clock or sleeps


@pytest.fixture
def counters(settings: Any) -> str:
    """A key prefix of this test's own on the suite's Redis; the prefix is returned."""
    if not isinstance(caches["default"], RedisCache):
        if os.environ.get("CI"):
            pytest.fail("CI must run the throttle counter tests on Redis (REDIS_URL)")
        pytest.skip("REDIS_URL is not set")
    prefix = f"throttle-{uuid.uuid4().hex}"
    settings.CACHES = {"default": {**settings.CACHES["default"], "KEY_PREFIX": prefix}}
    return prefix


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The throttle's clock: the test moves now[0]."""
    now = [T0]
    monkeypatch.setattr(PaidRequestThrottle, "timer", staticmethod(lambda: now[0]))
    return now


def _redis(settings: Any) -> redis.Redis:
    # A socket timeout only so a broken MONITOR fails the test instead of hanging it.
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=60)


def _commands_seen(settings: Any, prefix: str, send: Any) -> list[dict[str, Any]]:
    """Every command Redis executed that names one of this test's keys while `send()` ran,
    in order (MONITOR; the ECHO after `send()` marks the end, as Redis logs in order)."""
    client = _redis(settings)
    db = client.connection_pool.connection_kwargs.get("db", 0)
    end = f"end-{uuid.uuid4().hex}"
    seen = []
    with client.monitor() as monitor:
        send()
        client.echo(end)
        while True:
            command = monitor.next_command()
            if command["db"] != db:
                continue
            if end in command["command"]:
                break
            if prefix in command["command"]:
                seen.append(command)
    client.close()
    return seen


@pytest.mark.django_db
def test_a_keyed_request_is_one_redis_round_trip_for_both_scopes(
    counters, settings, make_client, buyer
):
    client = make_client(buyer)
    # Loads the script into Redis if no earlier test did (EVALSHA, then SCRIPT LOAD once).
    assert client.post("/x402/no-such-offering", {}, format="json").status_code == 404

    def send() -> None:
        for _ in range(3):
            assert client.post("/x402/no-such-offering", {}, format="json").status_code == 404

    seen = _commands_seen(settings, counters, send)
    from_the_app = [c["command"].split(" ")[0] for c in seen if c["client_type"] != "lua"]
    assert from_the_app == ["EVALSHA"] * 3
    # Inside the script: both scopes counted on every request.
    inside = Counter(c["command"].split(" ")[0] for c in seen if c["client_type"] == "lua")
    assert inside["ZADD"] == 2 * 3
    assert {c["command"].split(" ")[1] for c in seen if c["command"].startswith("ZADD")} == {
        f"{counters}:1:throttle:api_key:{buyer.ref}",
        f"{counters}:1:throttle:client_address:127.0.0.1",
    }


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_requests_are_allowed_exactly_up_to_the_limit(counters, settings, buyer):
    rates(settings, api_key="25/min")
    key = f"Bearer {api_key_issue(buyer=buyer)}"
    start = threading.Barrier(6)

    def agent(_: int) -> list[int]:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=key)
        start.wait()
        try:
            return [
                client.post("/x402/no-such-offering", {}, format="json").status_code
                for _ in range(10)
            ]
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=6) as pool:
        statuses = Counter(s for answers in pool.map(agent, range(6)) for s in answers)
    assert statuses == {404: 25, 429: 35}


def test_the_windows_are_all_or_nothing_under_threads(counters, settings):
    first, second = Window("api_key:a", 50, 60), Window("api_key:b", 50, 60)
    address = Window("client_address:10.0.0.1", 70, 60)
    start = threading.Barrier(8)

    def hits(window: Window, count: int) -> list[bool]:
        start.wait()
        return [rate_limit_hit(windows=[window, address], now=T0).allowed for _ in range(count)]

    with ThreadPoolExecutor(max_workers=8) as pool:
        allowed = [
            sum(f.result())
            for f in [pool.submit(hits, first if n % 2 else second, 20) for n in range(8)]
        ]
    assert sum(allowed) == 70
    client = _redis(settings)

    def stored(window: Window) -> int:
        return int(client.zcard(f"{counters}:1:throttle:{window.name}"))

    # Refused hits were counted nowhere: the keys' counts add up to the address's.
    assert stored(address) == 70
    assert stored(first) + stored(second) == 70
    assert max(stored(first), stored(second)) <= 50
    client.close()


@pytest.mark.django_db
def test_retry_after_is_when_the_oldest_hit_leaves_the_window(
    counters, settings, clock, make_client, buyer
):
    rates(settings, api_key="3/min")
    client = make_client(buyer)
    body = {"offering": "no-such-offering", "input": CSV_INPUT}
    for offset in (0, 10, 20):
        clock[0] = T0 + offset
        assert client.post("/api/v1/quotes", body, format="json").status_code == 404
    clock[0] = T0 + 30
    refused = client.post("/api/v1/quotes", body, format="json")
    assert_throttled(refused)
    assert refused["Retry-After"] == "30"
    clock[0] = T0 + 59.5
    assert client.post("/api/v1/quotes", body, format="json")["Retry-After"] == "1"
    clock[0] = T0 + 60.5  # the first hit has left the window; the refusals never entered it
    assert client.post("/api/v1/quotes", body, format="json").status_code == 404
    again = client.post("/api/v1/quotes", body, format="json")
    assert (again.status_code, again["Retry-After"]) == (429, "10")  # T0 + 10 leaves at + 70


def test_requests_in_fresh_contexts_share_the_processs_redis_connections(counters, settings):
    """Under ASGI every request runs in a context of its own, where Django's context-local
    `caches` makes a new cache object with a connection pool of its own: the throttle must
    not open a Redis connection per request (it did, at a twentieth of the CPU)."""
    client = _redis(settings)

    def hit(n: int) -> bool:
        return rate_limit_hit(windows=[Window(f"context-{n}", 100, 60)], now=T0).allowed

    assert contextvars.Context().run(hit, 0)  # the process's pool has its connection now
    before = client.info("stats")["total_connections_received"]
    assert all(contextvars.Context().run(hit, n) for n in range(1, 21))
    assert client.info("stats")["total_connections_received"] - before < 5


def test_the_process_memory_counters_of_the_embedded_demo_agree(settings):
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    windows = [Window("api_key:a", 2, 60), Window("client_address:10.0.0.1", 3, 60)]
    decisions = [rate_limit_hit(windows=windows, now=T0 + n) for n in range(3)]
    assert [d.allowed for d in decisions] == [True, True, False]
    assert decisions[2].wait == 58.0
    other = [Window("api_key:b", 2, 60), windows[1]]
    assert [rate_limit_hit(windows=other, now=T0 + 3).allowed for _ in range(2)] == [True, False]


@pytest.mark.django_db
def test_with_redis_unreachable_throttling_falls_back_to_process_memory(
    settings, make_client, buyer, offering, caplog
):
    """Issue 18 item 4: no Redis is no shared counter, not a failed request. The same rates
    are counted in process memory; each such decision is counted on /metrics and the outage
    is logged once, not per request."""
    rate_limit._fallback_cache.clear()
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": "redis://127.0.0.1:1/0",  # nothing listens on port 1
        }
    }
    rates(settings, api_key="2/min")
    fallbacks = _fallback_count()
    client = make_client(buyer)
    body = {"offering": offering.slug, "input": CSV_INPUT}
    answers = [client.post("/api/v1/quotes", body, format="json") for _ in range(3)]
    assert [a.status_code for a in answers[:2]] == [201, 200]  # the open quote, again
    assert_throttled(answers[2])  # the same rate, counted here
    assert Quote.objects.count() == 1  # the second quote was the first one's (idempotent)
    assert _fallback_count() == fallbacks + 3
    outage_lines = [r for r in caplog.records if "Redis unreachable" in r.getMessage()]
    assert len(outage_lines) == 1
    # What the throttles do not cover answers as ever.
    assert client.get("/api/v1/offerings").status_code == 200


def _fallback_count() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("tollbooth_throttle_fallback_total") or 0.0
