"""A paid request waiting for its result: run fast work inline, or be woken when it is stored.

Two mechanisms, both keeping the execution exactly-once:

- **Inline execution.** An offering whose executor finishes inside `start` (pure, in-process
  work such as `report`) is run by the waiting request itself, through the same
  `purchase_execute` a worker calls: the atomic execution claim lets exactly one caller run
  it. Inside `purchase_inline_execution_scope` the execution job its settlement stages is
  held back from the broker (`outbox_relay_held`): retired once the inline run has finished
  the job, so no worker receives a job only to find it done; sent at once when the run did
  not finish it (the executor's state unknown, an error, another worker holding the claim)
  or never happened. If this process dies first, the message is still waiting in the outbox
  and the relay loop sends it after its grace: a worker resumes the purchase.
- **Woken, not polling.** The transaction that stores a result (or ends the execution) sends
  a PostgreSQL NOTIFY (`purchases.sql.fulfillment_notify_send`), delivered only at its commit.
  One listener thread per process holds one LISTEN connection and wakes the requests waiting
  on that purchase. A waiter registers before it reads the state, so a notification sent
  between the read and the wait is not missed; and it reads the state again at least every
  `FALLBACK_CHECK_SECONDS`, so a lost notification (listener reconnecting, NOTIFY sent by
  an older release) costs at most that long. On the embedded SQLite of the demo, which has
  no NOTIFY, the waiter polls.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import psycopg
from django.db import connection

from core.sql import on_postgresql
from fulfillment.executors import get_executor
from purchases.models import Offering, Purchase
from purchases.selectors import purchase_reload
from purchases.services.fulfil.execution import (
    Executed,
    ExecutionOutcome,
    ExecutionRetryable,
    purchase_execute_keeping,
)
from purchases.services.fulfil.sweeper import EXECUTE_JOB, purchase_execution_key
from purchases.services.fulfil.upstreams import offering_executor
from purchases.services.shared.outbox import (
    outbox_relay_held,
    outbox_release_held,
    outbox_retire_held,
)
from purchases.sql import LISTEN_FULFILLMENT, fulfillment_state_read

logger = logging.getLogger(__name__)
RUN = Purchase.FulfillmentState

# A waiter re-reads the state this often even without a notification: the cost of a lost one.
FALLBACK_CHECK_SECONDS = 1.0
# The embedded SQLite has no NOTIFY: the demo polls at this interval.
SQLITE_POLL_SECONDS = 0.1
# How long a first waiter gives the listener to connect before relying on the fallback.
LISTENER_START_SECONDS = 1.0
_RECONNECT_SECONDS = 1.0
_STOP_CHECK_SECONDS = 1.0
WAITING_STATES = frozenset({RUN.QUEUED, RUN.RUNNING})
# An inline run with these outcomes left the purchase neither queued nor running: a worker
# would find nothing to do. Any other (observed, lease lost, retryable, an error) leaves the
# job to a worker.
_FINISHED = frozenset(
    {ExecutionOutcome.SUCCEEDED, ExecutionOutcome.FAILED, ExecutionOutcome.ESCALATED}
)


@contextmanager
def purchase_inline_execution_scope(*, offering: Offering, wait_seconds: float) -> Iterator[None]:
    """Around a paid request that will wait up to `wait_seconds` for `offering`'s work (its
    settlement, then `purchase_await_result`). When that request will run the work itself,
    the execution job staged inside is not sent to the broker after its commit:
    `purchase_await_result` retires it once the inline run has finished the job, or sends it
    at once; the scope's end sends whatever is left (no inline run happened). Otherwise the
    job is relayed after its commit as everywhere else.
    """
    inline = _runs_inline(offering, wait_seconds)
    # Decided once per request: the wait below reads the purchase's own copy of the offering,
    # which would read its upstream again.
    decided = _INLINE_DECIDED.set((offering.pk, inline))
    try:
        if not inline:
            yield
            return
        with outbox_relay_held(job=EXECUTE_JOB):
            yield
    finally:
        _INLINE_DECIDED.reset(decided)


def purchase_await_result(*, purchase: Purchase, wait_seconds: float) -> Purchase:
    """The purchase once its work left queued/running, or as it is after `wait_seconds`.

    Fast in-process work is run here (exactly once, under the execution claim) instead of
    waiting for a worker to take it from the queue; the execution job held back for it in
    `purchase_inline_execution_scope` is then retired, or sent if the run did not finish it.
    Work that scope decided to run inline runs even when `wait_seconds` is spent (what is
    left of a budget a slow settlement used up): it finishes in its start, so it is the
    work itself, not a wait for it.
    """
    if purchase.fulfillment_state not in WAITING_STATES:
        return purchase
    inline = _runs_inline(purchase.offering, wait_seconds)
    if not inline and wait_seconds <= 0:
        return purchase
    if inline:
        succeeded = _execute_inline(purchase.pk)
        if succeeded is not None:
            # The purchase as this run committed it (succeeded, with its result): nothing
            # to wait for, and nothing to read again.
            return succeeded
    state = fulfillment_wait(
        purchase_id=purchase.pk,
        waiting=WAITING_STATES,
        deadline=time.monotonic() + wait_seconds,
    )
    if state == purchase.fulfillment_state:
        return purchase
    return purchase_reload(purchase=purchase)


# (offering pk, runs inline) as decided by the request's purchase_inline_execution_scope.
_INLINE_DECIDED: ContextVar[tuple[int, bool] | None] = ContextVar("inline_decided", default=None)


def _runs_inline(offering: Offering, wait_seconds: float) -> bool:
    decided = _INLINE_DECIDED.get()
    if decided is not None and decided[0] == offering.pk:
        return decided[1]  # by the request's scope, on its whole budget
    if wait_seconds <= 0:
        return False
    name, upstream = offering_executor(offering)
    # Only in-process work runs in the web request: a seller's upstream may take its whole
    # timeout, which must not hold a web worker; a Celery worker calls it.
    return upstream is None and bool(get_executor(name).finishes_in_start)


def _execute_inline(purchase_id: int) -> Purchase | None:
    """Run the work here; the purchase as the run left it when it succeeded, else None."""
    worker = f"web:{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"
    executed: Executed | None = None
    try:
        executed = purchase_execute_keeping(purchase_id=purchase_id, worker=worker)
    except ExecutionRetryable:
        # Counted and on the timeline; the staged worker task (or the sweeper) retries it.
        logger.info("purchase %s: inline execution left to the worker", purchase_id)
    except Exception:
        # The payment stands and the job is still staged: the buyer gets the usual 202 and
        # the worker runs it under the same claim rules. Never a 500 for a paid call.
        logger.exception("purchase %s: inline execution failed; left to the worker", purchase_id)
    if executed is None:
        _settle_held_job(purchase_id, is_finished=False)
        return None
    _settle_held_job(purchase_id, is_finished=executed.outcome in _FINISHED)
    return executed.purchase


def _settle_held_job(purchase_id: int, *, is_finished: bool) -> None:
    """The execution job held back for this run (if any): retired when the run finished the
    purchase's work, else sent now for a worker. A failure here never fails the paid call:
    the message stays waiting, and the scope's end or the relay loop sends it."""
    key = purchase_execution_key(purchase_id)
    try:
        if is_finished:
            outbox_retire_held(dedup_key=key)
        else:
            outbox_release_held(dedup_key=key)
    except Exception:
        logger.exception(
            "purchase %s: held execution job not settled; the relay sends it", purchase_id
        )


def fulfillment_wait(
    *,
    purchase_id: int,
    waiting: Collection[str],
    deadline: float,
    fallback_seconds: float = FALLBACK_CHECK_SECONDS,
) -> str:
    """Block until the purchase's fulfilment state is not in `waiting`, or until `deadline`
    (a time.monotonic() value). Returns the last state read."""

    def read() -> str:
        # One fixed statement, not a queryset compiled on every look (core.prepared's why).
        state = fulfillment_state_read(purchase_id)
        if state is None:
            raise Purchase.DoesNotExist(f"purchase {purchase_id} does not exist")
        return state

    if not on_postgresql():  # no LISTEN: poll
        return _poll(read, waiting, deadline, SQLITE_POLL_SECONDS)
    listener = _listener()
    wake = listener.register(purchase_id)
    try:
        while True:
            state = read()  # after registering: a commit before this read is seen here
            remaining = deadline - time.monotonic()
            if state not in waiting or remaining <= 0:
                return state
            wake.wait(min(remaining, fallback_seconds))
            wake.clear()
    finally:
        listener.unregister(purchase_id, wake)


def _poll(read: Callable[[], str], waiting: Collection[str], deadline: float, every: float) -> str:
    state = read()
    while state in waiting and time.monotonic() < deadline:
        time.sleep(min(every, max(0.0, deadline - time.monotonic())))
        state = read()
    return state


class FulfillmentListener:
    """One LISTEN connection per process; wakes the threads waiting on a purchase."""

    def __init__(self, conninfo: dict[str, object]) -> None:
        self._conninfo = conninfo
        self._lock = threading.Lock()
        self._waiters: dict[int, set[threading.Event]] = {}
        self._listening = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.notifications = 0  # received, for tests and metrics

    def register(self, purchase_id: int) -> threading.Event:
        wake = threading.Event()
        with self._lock:
            self._waiters.setdefault(purchase_id, set()).add(wake)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="fulfillment-listener", daemon=True
                )
                self._thread.start()
        # The first waiter lets the listener connect; if it cannot, the fallback covers.
        self._listening.wait(LISTENER_START_SECONDS)
        return wake

    def unregister(self, purchase_id: int, wake: threading.Event) -> None:
        with self._lock:
            waiting = self._waiters.get(purchase_id)
            if waiting is not None:
                waiting.discard(wake)
                if not waiting:
                    del self._waiters[purchase_id]

    def _wake(self, payload: str) -> None:
        self.notifications += 1
        try:
            purchase_id = int(payload)
        except ValueError:
            return
        with self._lock:
            for wake in self._waiters.get(purchase_id, ()):
                wake.set()

    def _wake_all(self) -> None:
        # After a reconnect, notifications sent meanwhile are gone: everyone re-reads.
        with self._lock:
            for waiting in self._waiters.values():
                for wake in waiting:
                    wake.set()

    def close(self) -> None:
        """Stop listening and close the connection (tests; a process that exits need not)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._listen()
            except psycopg.Error as exc:
                logger.warning("fulfillment listener lost its connection: %s", exc)
            self._listening.clear()
            self._stopping.wait(_RECONNECT_SECONDS)

    def _listen(self) -> None:
        with psycopg.connect(**self._conninfo, autocommit=True) as conn:  # type: ignore[arg-type]
            conn.execute(LISTEN_FULFILLMENT)
            self._listening.set()
            self._wake_all()
            while not self._stopping.is_set():
                # Bounded, so a close() is noticed; a notification wakes it at once.
                for notify in conn.notifies(timeout=_STOP_CHECK_SECONDS):
                    self._wake(notify.payload)


_LISTENERS: dict[int, FulfillmentListener] = {}
_LISTENERS_LOCK = threading.Lock()


def _listener() -> FulfillmentListener:
    # Per process id: a forked child (a Celery or gunicorn worker) never inherits a thread.
    with _LISTENERS_LOCK:
        listener = _LISTENERS.get(os.getpid())
        if listener is None:
            listener = FulfillmentListener(connection.get_connection_params())
            _LISTENERS[os.getpid()] = listener
        return listener


def listeners_close() -> None:
    """Close this process's listener (its connection holds the database open)."""
    with _LISTENERS_LOCK:
        listener = _LISTENERS.pop(os.getpid(), None)
    if listener is not None:
        listener.close()
