"""Payment-id leases: who holds one, kept alive while its holder lives, given up when it dies.

A request holding a payment id must not block the buyer's retry one second longer than it
lives. A fixed lease cannot tell a slow request from a dead one, so a lease is short and
renewed:

- The lease token names its holder: `<instance>.<request token>`, the instance being a
  random id of this process (made again in a forked child).
- A claim writes `locked_until = now + 4 beats` (IDEMPOTENCY_HEARTBEAT, 2 s: 8 s). While
  the request runs, a thread of this process renews every lease the process holds, all in
  one UPDATE per beat (`_beat`), off the request path: a paid request sends no statement
  more. Each lease is renewed at most up to IDEMPOTENCY_LEASE after its claim, so a hung
  request still gives the id up.
- A holder that dies (SIGKILL, OOM, a lost host) stops renewing; its lease runs out within
  4 beats and the next retry takes it over (on any process).
- A request that fails in a live process gives its id back at once
  (`idempotent_request`). If the database is unreachable then, the release waits here and
  is sent at the next beat the database answers; meanwhile a retry reaching this process
  sees at once that no live request holds the token (`lease_abandoned`).

Nothing here is a session-level resource (an advisory lock, a LISTEN): each statement
stands alone, so it works the same on the embedded SQLite file, on PostgreSQL and behind
a transaction-pooling PgBouncer. On a SQLite memory database (tests) only this process
exists, so the live set alone decides and no thread runs.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import reduce
from operator import or_

from django.conf import settings
from django.db import connection
from django.db.models import Q
from django.utils import timezone

from purchases.models import IdempotencyRecord

logger = logging.getLogger(__name__)

# A lease not renewed for this many beats belongs to a dead holder. More than one, so a
# beat delayed by a busy machine or a slow commit never hands a live request's id over.
BEATS_TO_DEAD = 4


@dataclass
class _Process:
    """This process's leases: held by a running request, or to be released."""

    instance: str = field(default_factory=lambda: secrets.token_hex(6))
    lock: threading.Lock = field(default_factory=threading.Lock)
    # token -> (record id, the latest time its lease may be renewed to)
    held: dict[str, tuple[int, datetime]] = field(default_factory=dict)
    # token -> record id: requests that failed while the database was unreachable
    pending: dict[str, int] = field(default_factory=dict)
    wake: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    failing: bool = False


_process = _Process()


def _forked() -> None:
    """A forked child (a gunicorn worker) is a holder of its own: new instance, no leases."""
    global _process
    _process = _Process()


os.register_at_fork(after_in_child=_forked)


def _beat_seconds() -> float:
    return float(settings.TOLLBOOTH["IDEMPOTENCY_HEARTBEAT"].total_seconds())


def _renewed() -> bool:
    """False on a SQLite memory database: one process, nobody else to tell."""
    # is_in_memory_db is the SQLite wrapper's own.
    return not (connection.vendor == "sqlite" and connection.is_in_memory_db())  # type: ignore[attr-defined]


def lease_token_new() -> str:
    """A token naming this process as the holder (fits the 32-character column)."""
    return f"{_process.instance}.{secrets.token_hex(8)}"


def lease_until(now: datetime) -> datetime:
    """Where a new or taken-over lease ends unless renewed."""
    if not _renewed():
        return now + settings.TOLLBOOTH["IDEMPOTENCY_LEASE"]
    return now + BEATS_TO_DEAD * settings.TOLLBOOTH["IDEMPOTENCY_HEARTBEAT"]


def lease_hold(*, token: str, record_id: int, now: datetime) -> None:
    """A request of this process now holds `token`: renew it until `lease_done`."""
    process = _process
    with process.lock:
        process.held[token] = (record_id, now + settings.TOLLBOOTH["IDEMPOTENCY_LEASE"])
        process.pending.pop(token, None)
        if process.thread is None and _renewed():
            process.thread = threading.Thread(
                target=_run, args=(process,), name="tollbooth-lease-heartbeat", daemon=True
            )
            process.thread.start()


def lease_done(*, token: str) -> None:
    """The request holding `token` has finished (answered, released, or failed)."""
    with _process.lock:
        _process.held.pop(token, None)


def lease_release_later(*, token: str, record_id: int) -> None:
    """The release of `token` failed (database unreachable): send it at the next beat."""
    process = _process
    with process.lock:
        process.pending[token] = record_id
    process.wake.set()


def lease_abandoned(token: str) -> bool:
    """True if `token` is this process's and no request of it holds it any more: its
    request ended without storing an answer or giving the id back (the database was
    unreachable then). A token of another process is judged by its renewals instead."""
    instance, dot, _ = token.partition(".")
    if not dot or instance != _process.instance:
        return False
    with _process.lock:
        return token not in _process.held


def _run(process: _Process) -> None:
    while process is _process:
        process.wake.wait(_beat_seconds())
        process.wake.clear()
        try:
            _beat(process, timezone.now())
        except Exception as exc:  # the database is away: try again next beat
            if not process.failing:
                logger.warning("payment-id lease heartbeat failed (retried each beat): %r", exc)
            process.failing = True
        else:
            if process.failing:
                logger.info("payment-id lease heartbeat resumed")
            process.failing = False
        finally:
            # A connection per beat: nothing held between beats (a PgBouncer slot, or a
            # session a test database's teardown would wait for).
            connection.close()


def _beat(process: _Process, now: datetime) -> None:
    """Renew every lease this process holds (one UPDATE); send the releases still owed
    (one UPDATE). Nothing when it holds none."""
    with process.lock:
        process.held = {t: held for t, held in process.held.items() if held[1] > now}
        held = dict(process.held)
        pending = dict(process.pending)
    in_flight = IdempotencyRecord.objects.filter(state=IdempotencyRecord.State.IN_FLIGHT)
    if held:
        in_flight.filter(
            pk__in=[record_id for record_id, _ in held.values()], lease_token__in=list(held)
        ).update(locked_until=now + BEATS_TO_DEAD * timedelta(seconds=_beat_seconds()))
    if pending:
        owed = reduce(or_, (Q(pk=pk, lease_token=token) for token, pk in pending.items()))
        in_flight.filter(owed).update(locked_until=None, lease_token="")
        with process.lock:
            for token in pending:
                process.pending.pop(token, None)
        logger.info("payment-id leases released after the database returned: %d", len(pending))
