"""Sliding-window rate limits: every window of one request checked and counted at once.

A window is "at most `limit` hits in any `seconds`": a log of hit times, as DRF's
SimpleRateThrottle keeps, so the rates mean what they meant. All of a request's windows (its
API key, its client address) are decided together and all-or-nothing: a hit is counted in
every window or, if any window is full, in none (a refused request uses up no quota).

Where the default cache is Redis (every web process shares it), the decision is one Lua
script, so one round trip whatever the number of windows, and atomic: concurrent requests
can never both take the last place. Otherwise (the embedded demo's process memory) the same
algorithm runs under a process lock.

If Redis cannot be reached, throttling degrades instead of failing the request: the same
windows are decided in this process's memory (the embedded algorithm, the same rates, but
per process: N web processes let through up to N times the rate), logged once per outage,
counted on `tollbooth_throttle_fallback_total`, and Redis is probed again every
`_PROBE_SECONDS`; the first decision it answers ends the outage (docs/security.md).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from django.core.cache import caches
from django.core.cache.backends.locmem import LocMemCache
from django.core.cache.backends.redis import RedisCache
from prometheus_client import Counter
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

throttle_fallbacks = Counter(
    "tollbooth_throttle_fallback_total",
    "Throttle decisions made in process memory because Redis could not be reached.",
)

# KEYS: one sorted set per window (member: one hit, score: its time in seconds).
# ARGV: now, the hit's member, then limit and seconds for each key in order.
# Returns {1, 0} if counted in every window, else {0, milliseconds until it would be}.
_SLIDING_WINDOWS_LUA = """
local now = tonumber(ARGV[1])
local wait = 0
for i, key in ipairs(KEYS) do
    local limit = tonumber(ARGV[1 + 2 * i])
    local seconds = tonumber(ARGV[2 + 2 * i])
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now - seconds)
    local count = redis.call('ZCARD', key)
    if count >= limit then
        local freed = redis.call('ZRANGE', key, count - limit, count - limit, 'WITHSCORES')
        local key_wait = seconds
        if freed[2] then
            key_wait = tonumber(freed[2]) + seconds - now
        end
        wait = math.max(wait, key_wait)
    end
end
if wait > 0 then
    return {0, math.ceil(wait * 1000)}
end
for i, key in ipairs(KEYS) do
    redis.call('ZADD', key, now, ARGV[2])
    redis.call('PEXPIRE', key, math.ceil(tonumber(ARGV[2 + 2 * i]) * 1000))
end
return {1, 0}
"""

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_local_lock = threading.Lock()
_script: Any = None
# One redis-py client and connection pool per process and server: Django's cache makes a
# new client on every call, whose construction cost more CPU than the throttle's round trip
# (issue 11), and a new cache object, with a pool of its own, in every fresh context
# (`caches` is context-local): on the ASGI role that is every request, so each paid call
# opened new Redis connections, the connect, handshake and driver-info look-up a twentieth
# of the workers' CPU at 64 agents (issue 22). A pool is thread-safe and reconnects in a
# forked worker; the key has the process id all the same, so none crosses a fork.
_clients: dict[tuple[int, str, str], Any] = {}
_clients_lock = threading.Lock()
# While Redis is unreachable, each process counts in its own memory (a cache of its own, so
# an outage's counts never mix with anything else) and asks Redis again this often: often
# enough that shared limits resume within seconds, rarely enough that a dead Redis costs
# one failed connect per process per period, not one per request.
_PROBE_SECONDS = 2.0
_fallback_cache = LocMemCache("tollbooth-throttle-fallback", {})


@dataclass
class _Outage:
    since: float | None = None  # monotonic time of the first failure; None while Redis answers
    probe_at: float = 0.0


_outage = _Outage()


@dataclass(frozen=True)
class Window:
    """At most `limit` hits in any `seconds`, counted under `name` (e.g. "api_key:buy_...")."""

    name: str
    limit: int
    seconds: int


@dataclass(frozen=True)
class Decision:
    allowed: bool
    # Seconds until the request would be allowed (0 when it is).
    wait: float = 0.0


def parse_rate(rate: str) -> tuple[int, int]:
    """DRF's rate form `<n>/<sec|min|hour|day>` (only the unit's first letter counts)."""
    count, _, period = rate.partition("/")
    return int(count), _UNITS[period[0]]


def rate_limit_hit(*, windows: list[Window], now: float) -> Decision:
    """Count one hit in every window, or in none if any is full (then: how long to wait).

    Never raises for an unreachable Redis: the process decides alone meanwhile.
    """
    if not windows:
        return Decision(True)
    cache = caches["default"]
    keys = [cache.make_key(f"throttle:{window.name}") for window in windows]
    if isinstance(cache, RedisCache):
        return _shared_hit(cache, keys, windows, now)
    return _local_hit(cache, keys, windows, now)


def _shared_hit(cache: RedisCache, keys: list[str], windows: list[Window], now: float) -> Decision:
    """Redis's decision, or this process's own while Redis cannot be reached."""
    if _outage.since is not None and time.monotonic() < _outage.probe_at:
        throttle_fallbacks.inc()
        return _local_hit(_fallback_cache, keys, windows, now)
    try:
        decision = _redis_hit(cache, keys, windows, now)
    except (RedisError, OSError) as exc:
        _outage_noted(exc)
        throttle_fallbacks.inc()
        return _local_hit(_fallback_cache, keys, windows, now)
    if _outage.since is not None:
        logger.warning(
            "throttling: Redis answers again after %.1f s; shared limits resumed",
            time.monotonic() - _outage.since,
        )
        _outage.since = None
    return decision


def _outage_noted(exc: Exception) -> None:
    """Logged once per outage (its first failure), not per request."""
    started = _outage.since is None
    clock = time.monotonic()
    if started:
        _outage.since = clock
    _outage.probe_at = clock + _PROBE_SECONDS
    if started:
        logger.error(
            "throttling: Redis unreachable (%r); limits are counted per process until it "
            "answers again",
            exc,
        )


def _redis_hit(cache: RedisCache, keys: list[str], windows: list[Window], now: float) -> Decision:
    global _script  # registered once per process, on first use
    client = _client(cache)
    if _script is None:
        _script = client.register_script(_SLIDING_WINDOWS_LUA)
    # The hit's member in each sorted set: unique, so two hits in the same microsecond count twice.
    args: list[Any] = [repr(now), f"{now:.6f}:{secrets.token_hex(6)}"]
    for window in windows:
        args += [window.limit, window.seconds]
    # EVALSHA: one round trip (redis-py loads the script once if the server lacks it).
    allowed, wait_ms = _script(keys=keys, args=args, client=client)
    return Decision(bool(allowed), int(wait_ms) / 1000)


def _client(cache: RedisCache) -> Any:
    """A client on the cache's write server, made once per process (its pool's options)."""
    backend: Any = cache._cache
    server, options = backend._servers[0], backend._pool_options
    key = (os.getpid(), server, repr(sorted(options.items())))
    client = _clients.get(key)
    if client is None:
        with _clients_lock:
            client = _clients.get(key)
            if client is None:
                pool = backend._pool_class.from_url(server, **options)
                client = _clients[key] = backend._client(connection_pool=pool)
    return client


def _local_hit(cache: Any, keys: list[str], windows: list[Window], now: float) -> Decision:
    with _local_lock:
        logs = []
        wait = 0.0
        for key, window in zip(keys, windows, strict=True):
            log = [t for t in cache.get(key, []) if t > now - window.seconds]
            logs.append(log)
            if len(log) >= window.limit:
                freed = sorted(log)[len(log) - window.limit] if window.limit > 0 else now
                wait = max(wait, freed + window.seconds - now)
        if wait > 0:
            return Decision(False, math.ceil(wait * 1000) / 1000)
        for key, window, log in zip(keys, windows, logs, strict=True):
            cache.set(key, [*log, now], window.seconds)
        return Decision(True)
