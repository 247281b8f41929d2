"""The outbox: a job is staged in the transaction that calls for it and relayed to Celery.

Staging (`outbox_stage`) is one INSERT in the caller's transaction, so the job exists if
and only if the change does. Right after the commit the immediate relay sends it and marks
it relayed (one UPDATE), so a paid request waiting for a fast job still gets its result in
one round trip. What the immediate relay could not send (broker down) or never sent (the
process died after the commit) the relay loop sends (`outbox_relay_due`, beat): it claims
due rows with `SKIP LOCKED` and by pushing `available_at` forward, commits, and only then
talks to the broker, so no lock is held over network I/O and two loops never send one row.

A request that will run a job itself (a paid request running fast work inline) stages it
inside `outbox_relay_held`: the message is committed as usual but not sent after the commit.
The request then retires it (`outbox_retire_held`: one UPDATE, it is never sent) once it
has done the job, or sends it at once (`outbox_release_held`, and on leaving the block,
whatever it did not settle). If the process dies in between, the message is still waiting
with its grace and the relay loop sends it: nothing is lost.

Delivery is at least once: a process that dies between the send and the mark sends again
later. Every job takes ids and its task re-reads and re-checks the rows they name.
Services name jobs by string; `settings.OUTBOX_JOBS` maps them to Celery tasks, so nothing
here or in any service imports `purchases.tasks`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from celery import Celery, current_app
from django.conf import settings
from django.db import transaction
from django.db.models import F, QuerySet

from core.backoff import backoff_delay
from core.clock import now_or
from core.prepared import PreparedUpdate
from purchases import sql
from purchases.models import OUTBOX_WAITING, JobRun, OutboxMessage
from purchases.services.shared.job_runs import job_run

logger = logging.getLogger(__name__)

# A loop's claimed rows are invisible to other loops this long; a loop that died after its
# claim and before its send gives them back after it. Far longer than a batch takes to send.
SEND_CLAIM = timedelta(minutes=1)
RELAY_BATCH = 100
# One run sends at most this many, so a huge backlog cannot hold a worker for long.
RELAY_MAX_PER_RUN = 5_000
# Broker unreachable: try again after 2, 4, 8 ... s, at most 5 min (with jitter).
BACKOFF_CAP_SECONDS = 300.0
PRUNE_BATCH = 1_000
RELAY_JOB = "outbox_relay"
# Jobs run every few seconds, whose JobRun rows are pruned with the outbox: (job, stat).
FREQUENT_JOBS = ((RELAY_JOB, "relay_runs_pruned"), ("heal_relayers", "heal_runs_pruned"))


def _waiting(message_id: int) -> QuerySet[OutboxMessage]:
    return OutboxMessage.objects.filter(OUTBOX_WAITING, pk=message_id)


# A message sent, or its job done by the request that staged it (retired), marked so if
# still waiting: after every staging commit and every inline run, compiled once
# (core.prepared).
_MARK_RELAYED = PreparedUpdate(
    lambda message_id, now: (
        _waiting(message_id),
        {"relayed_at": now, "attempts": F("attempts") + 1},
    ),
    message_id=int,
    now=datetime,
)
_MARK_RETIRED = PreparedUpdate(
    lambda message_id, now: (_waiting(message_id), {"retired_at": now}),
    message_id=int,
    now=datetime,
)


def outbox_stage(
    *,
    job: str,
    kwargs: dict[str, Any],
    dedup_key: str | None = None,
    now: datetime | None = None,
    relay_at_commit: bool = True,
) -> int | None:
    """Stage `job(**kwargs)` in the caller's transaction; it is relayed after the commit
    (inside `outbox_relay_held` for its job, the caller settles it instead).
    `relay_at_commit=False`: a backstop for work someone is expected to do at once; the
    relay loop sends it only after its grace (its job re-checks and finds nothing to do).

    Returns the message id, or None when a message with this `dedup_key` is already waiting
    to be relayed (that one carries the job). Raises RuntimeError outside a transaction (a
    job staged there would survive the rollback of the change that called for it) and
    ValueError for a job that is not in `settings.OUTBOX_JOBS`.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("outbox_stage must run inside the transaction of the change")
    if job not in settings.OUTBOX_JOBS:
        raise ValueError(f"unknown outbox job {job!r}")
    now = now_or(now)
    row = [
        job,
        kwargs,
        dedup_key,
        now,
        now + settings.TOLLBOOTH["OUTBOX_RELAY_GRACE"],
    ]
    # A duplicate is the normal case, not an error: skipped, never a failing INSERT. The
    # flow's timeline events so far are written in the same statement.
    written = sql.outbox_insert([row], with_events=True)
    if not written:
        return None
    message_id = written[0]
    if not relay_at_commit:
        return message_id
    hold = _HOLD.get()
    after_commit = (
        partial(hold.keep, message_id=message_id, dedup_key=dedup_key, kwargs=kwargs)
        if hold is not None and hold.job == job and dedup_key is not None
        else partial(_relay_staged, message_id=message_id, job=job, kwargs=kwargs)
    )
    # robust: a failing relay must never turn a committed change into an error for the caller.
    transaction.on_commit(after_commit, robust=True)
    return message_id


@dataclass
class _Hold:
    """The messages of `job` staged and committed inside one `outbox_relay_held` block, by
    dedup key: (id, kwargs). Only this thread's context sees it."""

    job: str
    held: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)
    is_open: bool = True

    def keep(self, *, message_id: int, dedup_key: str, kwargs: dict[str, Any]) -> None:
        """After the staging commit: keep it back, unless the block is already over."""
        if self.is_open:
            self.held[dedup_key] = (message_id, kwargs)
        else:
            _relay_staged(message_id=message_id, job=self.job, kwargs=kwargs)

    def release(self, dedup_key: str) -> None:
        message_id, kwargs = self.held.pop(dedup_key)
        _relay_staged(message_id=message_id, job=self.job, kwargs=kwargs)


_HOLD: ContextVar[_Hold | None] = ContextVar("outbox_hold", default=None)


@contextmanager
def outbox_relay_held(*, job: str) -> Iterator[None]:
    """Inside: a message of `job` staged with a dedup key is not sent after its commit; the
    caller means to do the job itself and settles it with `outbox_retire_held` (done, never
    send it) or `outbox_release_held` (send it now). Whatever it has not settled when the
    block ends, however it ends, is sent then, as the immediate relay would have. Messages of
    other jobs are relayed as usual. A block inside one for the same job is part of it.

    Raises RuntimeError inside a block holding another job (one job is held at a time).
    """
    outer = _HOLD.get()
    if outer is not None:
        if outer.job != job:
            raise RuntimeError(f"outbox relay already held for {outer.job!r}")
        yield
        return
    hold = _Hold(job)
    token = _HOLD.set(hold)
    try:
        yield
    finally:
        _HOLD.reset(token)
        hold.is_open = False
        for dedup_key in list(hold.held):
            try:
                hold.release(dedup_key)
            except Exception:  # the relay loop sends it after its grace
                logger.exception("outbox: held message %s not sent at the block's end", dedup_key)


def outbox_retire_held(*, dedup_key: str, now: datetime | None = None) -> bool:
    """The job of the message held under `dedup_key` in this `outbox_relay_held` block was
    done by the caller: retire it (one UPDATE), so it is never sent. True if it was; False,
    and no statement, when nothing is held under that key (not staged here, or already
    settled); False too if the relay loop sent it first (past its grace). A loop that claimed
    it just before still sends it and marks it relayed as well: the job re-checks its rows
    and finds nothing to do."""
    hold = _HOLD.get()
    if hold is None or dedup_key not in hold.held:
        return False
    message_id, _ = hold.held.pop(dedup_key)
    return _MARK_RETIRED.run(message_id=message_id, now=now_or(now)) == 1


def outbox_release_held(*, dedup_key: str) -> None:
    """Send the message held under `dedup_key` now (the caller did not do its job); nothing
    when none is held under it."""
    hold = _HOLD.get()
    if hold is not None and dedup_key in hold.held:
        hold.release(dedup_key)


def outbox_stage_many(
    *, job: str, messages: list[tuple[dict[str, Any], str]], now: datetime | None = None
) -> list[int]:
    """Stage many `job(**kwargs)` at once, each with its dedup key: one INSERT per
    RELAY_BATCH, in the caller's transaction, due at once for the relay loop.

    For batch jobs (reconciliation), where nobody waits on the answer: they are not sent
    right after the commit, as `outbox_stage` does for a waiting request (a broker send
    per message would cost the batch more than all its statements); the relay loop sends
    them on its next run, in batches. `messages` holds (kwargs, dedup_key) pairs. Returns
    the ids staged (a dedup key already waiting is skipped, as in `outbox_stage`). Raises
    as `outbox_stage` does.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("outbox_stage_many must run inside the transaction of the change")
    if job not in settings.OUTBOX_JOBS:
        raise ValueError(f"unknown outbox job {job!r}")
    now = now_or(now)
    staged: list[int] = []
    for start in range(0, len(messages), RELAY_BATCH):
        chunk = messages[start : start + RELAY_BATCH]
        rows = [[job, kwargs, dedup_key, now, now] for kwargs, dedup_key in chunk]
        staged += sql.outbox_insert(rows)
    return staged


def _celery() -> Celery:
    return current_app  # type: ignore[return-value]


def _send(job: str, kwargs: dict[str, Any]) -> None:
    _celery().send_task(settings.OUTBOX_JOBS[job], kwargs=kwargs)


def _backoff(attempts: int) -> timedelta:
    return backoff_delay(
        attempts, base_seconds=2.0, cap_seconds=BACKOFF_CAP_SECONDS, jitter=(0.75, 1.0)
    )


def _record_failure(message_id: int, attempts: int, exc: Exception, now: datetime) -> None:
    OutboxMessage.objects.filter(OUTBOX_WAITING, pk=message_id).update(
        attempts=attempts + 1,
        last_error=repr(exc)[:2000],
        available_at=now + _backoff(attempts + 1),
    )


# After an immediate send failed (the broker unreachable), requests stop trying for this
# long: each try costs a paying request the client's connect-and-retry time (about 0.8 s on
# a refused Redis), and the relay loop sends what they staged once the broker is back.
IMMEDIATE_PAUSE_SECONDS = 5.0
_immediate_paused_until = 0.0


def _relay_staged(*, message_id: int, job: str, kwargs: dict[str, Any]) -> None:
    """Right after the staging commit: send it now. Best effort; the loop covers a failure."""
    global _immediate_paused_until  # one process-wide pause, whichever request saw the failure
    if time.monotonic() < _immediate_paused_until:
        return  # the message waits, due after its grace, for the relay loop
    try:
        _send(job, kwargs)
    except Exception as exc:
        _immediate_paused_until = time.monotonic() + IMMEDIATE_PAUSE_SECONDS
        logger.warning(
            "outbox %s (%s) not sent now; the relay loop retries: %r", message_id, job, exc
        )
        _record_failure(message_id, 0, exc, now_or(None))
        return
    _MARK_RELAYED.run(message_id=message_id, now=now_or(None))


def outbox_relay_due(
    *, now: datetime | None = None, limit: int = RELAY_MAX_PER_RUN
) -> Counter[str]:
    """Send every message due (past its grace or backoff) and still waiting; the relay loop.

    Stops at the first broker failure: the failed row backs off, the rest of its batch is
    given back for the next run. Stats: `claimed`, `sent`, `failed`, `given_back`.
    """
    now = now_or(now)
    with job_run(RELAY_JOB, now) as stats:
        while stats["claimed"] < limit:
            batch = _claim_due(now, min(RELAY_BATCH, limit - stats["claimed"]))
            stats["claimed"] += len(batch)
            if not _send_batch(batch, now, stats) or len(batch) < RELAY_BATCH:
                break
    return stats


def _claim_due(now: datetime, size: int) -> list[OutboxMessage]:
    with transaction.atomic():
        batch = list(
            OutboxMessage.objects.select_for_update(skip_locked=True)
            .filter(OUTBOX_WAITING, available_at__lte=now)
            .order_by("available_at", "pk")
            .only("pk", "job", "kwargs", "attempts")[:size]
        )
        if batch:
            OutboxMessage.objects.filter(pk__in=[m.pk for m in batch]).update(
                available_at=now + SEND_CLAIM
            )
    return batch


def _send_batch(batch: list[OutboxMessage], now: datetime, stats: Counter[str]) -> bool:
    """Send outside any transaction; False once the broker failed (the run stops there)."""
    sent: list[int] = []
    healthy = True
    for index, message in enumerate(batch):
        try:
            _send(message.job, message.kwargs)
        except Exception as exc:
            logger.exception("outbox relay: %s %s not sent", message.job, message.pk)
            _record_failure(message.pk, message.attempts, exc, now)
            stats["failed"] += 1
            rest = [m.pk for m in batch[index + 1 :]]
            OutboxMessage.objects.filter(pk__in=rest).update(available_at=now)
            stats["given_back"] += len(rest)
            healthy = False
            break
        sent.append(message.pk)
    OutboxMessage.objects.filter(pk__in=sent).update(relayed_at=now, attempts=F("attempts") + 1)
    stats["sent"] += len(sent)
    return healthy


def outbox_prune(*, now: datetime | None = None) -> Counter[str]:
    """Delete messages relayed or retired past `OUTBOX_RETENTION`, in batches; and the JobRun
    rows past it of the jobs that run every few seconds (the relay loop, heal-relayers),
    keeping each one's last success (the lag metric reads the relay's). Stats: `pruned`,
    `relay_runs_pruned`, `heal_runs_pruned`."""
    now = now_or(now)
    cutoff = now - settings.TOLLBOOTH["OUTBOX_RETENTION"]
    with job_run("prune_outbox", now) as stats:
        relayed = OutboxMessage.objects.filter(relayed_at__lt=cutoff)
        retired = OutboxMessage.objects.filter(retired_at__lt=cutoff)
        stats["pruned"] = _delete_in_batches(relayed) + _delete_in_batches(retired)
        for job, stat in FREQUENT_JOBS:
            last_success = (
                JobRun.objects.filter(job=job, finished_at__isnull=False, error="")
                .order_by("-started_at")
                .values_list("pk", flat=True)
                .first()
            )
            old_runs = JobRun.objects.filter(job=job, started_at__lt=cutoff)
            if last_success is not None:
                old_runs = old_runs.exclude(pk=last_success)
            stats[stat] = _delete_in_batches(old_runs)
    return stats


def _delete_in_batches(rows: Any) -> int:
    deleted = 0
    while True:
        ids = list(rows.order_by("pk").values_list("pk", flat=True)[:PRUNE_BATCH])
        if ids:
            rows.model.objects.filter(pk__in=ids).delete()
        deleted += len(ids)
        if len(ids) < PRUNE_BATCH:
            return deleted
