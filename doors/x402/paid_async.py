"""The x402 paid URL on an event loop: a payment waiting for its block holds no thread.

The ASGI app (config/asgi.py, config/urls_asgi.py) routes `/x402/<offering>` here. The
request runs the paid view (X402PaidApi, unchanged) in a thread with waits returned
(doors.x402.waiting): everything up to the broadcast runs as before; if the receipt is not
there at the first look, the paid flow returns its wait as a value and the view answers
`HandedOff` with it instead of sleeping. This coroutine then sleeps on the event loop until
the chain's head moves (one watcher per loop and node looks at the head for every waiting
payment, `core.waits.Pacing`), looks for the receipt (a short hop to a thread, once per
block) and resumes the flow (record the outcome, run or await the work, answer) in a
thread, exactly the code the blocking wait would have run next, so the answer is the one
the WSGI view gives. Thousands of payments can wait on one loop; at
most TOLLBOOTH_X402_THREADS threads per process run their synchronous parts, the head
watcher's looks among them (`_look`).

Once handed off, the rest runs to its end even if the client goes away (shielded), as the
blocking view's thread would: the settlement is recorded and the answer stored under the
payment id, for the retry.

Driven by a synchronous caller (the WSGI server, Django's test client), the same view runs
its parts on the caller's thread (thread-sensitive), as a synchronous view would.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.http import HttpRequest, HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from doors.x402.views import HandedOff, X402PaidApi, X402PassThroughApi
from doors.x402.waiting import Waiting, waits_returned
from purchases.services.checkout.flow import purchase_pay_resume

T = TypeVar("T")
R = TypeVar("R")

_PAID_VIEW = X402PaidApi.as_view()
_PASSED_VIEW = X402PassThroughApi.as_view()
_ON_EVENT_LOOP: ContextVar[bool] = ContextVar("x402_paid_on_event_loop", default=False)
_EXECUTORS: dict[tuple[int, int], ThreadPoolExecutor] = {}
_EXECUTORS_LOCK = threading.Lock()


@contextmanager
def served_on_event_loop() -> Iterator[None]:
    """Around an ASGI request (config/asgi.py): the paid URL's synchronous parts run in this
    process's bounded pool, not on a thread of the caller's."""
    token = _ON_EVENT_LOOP.set(True)
    try:
        yield
    finally:
        _ON_EVENT_LOOP.reset(token)


def _executor() -> ThreadPoolExecutor:
    # Per process id (a forked worker never inherits a pool or its threads) and size.
    key = (os.getpid(), int(settings.TOLLBOOTH["X402_THREADS"]))
    with _EXECUTORS_LOCK:
        executor = _EXECUTORS.get(key)
        if executor is None:
            executor = ThreadPoolExecutor(max_workers=key[1], thread_name_prefix="x402-paid")
            _EXECUTORS[key] = executor
        return executor


def _with_connection(work: Callable[[], T]) -> Callable[[], T]:
    """Pool threads outlive the request: check their connection out and back in as Django
    does around a request (the request signals fire on another thread)."""

    def run() -> T:
        close_old_connections()
        try:
            return work()
        finally:
            close_old_connections()

    return run


async def _run_sync(work: Callable[[], T], *, uses_database: bool = True) -> T:
    if _ON_EVENT_LOOP.get():
        job = _with_connection(work) if uses_database else work
        return await sync_to_async(job, thread_sensitive=False, executor=_executor())()
    return await sync_to_async(work, thread_sensitive=True)()


async def _look(work: Callable[[], T]) -> T:
    # A look at the chain: no database, so no connection check around it.
    return await _run_sync(work, uses_database=False)


@csrf_exempt
async def x402_paid(
    request: HttpRequest, offering: str, rest: str | None = None
) -> HttpResponseBase:
    """X402PaidApi (X402PassThroughApi below the offering's URL), with its wait for the
    block on the event loop."""

    def first_part() -> HttpResponseBase:
        with waits_returned():
            response: HttpResponseBase = (
                _PAID_VIEW(request, offering=offering)
                if rest is None
                else _PASSED_VIEW(request, offering=offering, rest=rest)
            )
            return response

    response = await _run_sync(first_part)
    if isinstance(response, HandedOff):
        return await waited(response.waiting)
    return response


# What drf-spectacular and the URL tooling read from a DRF view function.
x402_paid.cls = X402PaidApi  # type: ignore[attr-defined]
x402_paid.initkwargs = {}  # type: ignore[attr-defined]


async def waited(waiting: Waiting[R]) -> R:
    """A payment's wait slept through on this loop (looks as short hops to the pool), then
    the flow resumed and the door's answer finished, in a pool thread."""
    pending = waiting.pending

    async def through() -> R:
        outcome = await pending.receipt.ended(_look)
        return await _run_sync(
            lambda: waiting.finish(lambda: purchase_pay_resume(pending, outcome))
        )

    # Shielded: a client gone mid-wait does not stop the settlement being recorded.
    return await asyncio.shield(through())


async def run_paid_call(work: Callable[[], R | Waiting[R]]) -> R:
    """`work` for a caller on an event loop that serves no Django request (the MCP server):
    in the pool, with waits returned; a Waiting it answers is slept through here, as the
    paid URL's is."""

    def first_part() -> R | Waiting[R]:
        with waits_returned():
            return work()

    with served_on_event_loop():
        answered = await _run_sync(first_part)
        if isinstance(answered, Waiting):
            return await waited(answered)
        return answered
