"""A wait handed to the caller's event loop instead of holding a thread (docs/deployment.md).

A paid request that waits for its block spends almost all its time asleep between cheap
looks at the chain. Synchronous code (the ORM, the settlement, the answer) cannot sleep
without its thread; so a polling wait does its first look, then raises `Handoff` instead of
sleeping, when two things hold: the caller is an event loop that completes handoffs
(`waits_handed_off`, the outermost frame), and the wait runs inside `handoff_allowed` (the
one call whose every layer, up to that caller, is wired for it). Every such layer that has
work left after the wait adds that work to the handoff (`then`, or `around` for a layer
that wraps it: a try/except, a scope) and re-raises. The caller sleeps with asyncio between
looks (each look a short hop to a thread) and then runs `resume` in a thread: the same code
the blocking wait would have run next, with the value the wait ended on. Anywhere else (a
resubmission, a reconciliation, a synchronous server) the wait blocks, as it always did.

Layers that unwind must hold nothing across the wait: no transaction is open around a
network wait (the settlement's rule), and a scope is re-entered by its `around`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Generator, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_CALLER_COMPLETES: ContextVar[bool] = ContextVar("waits_handed_off", default=False)
_ALLOWED: ContextVar[bool] = ContextVar("handoff_allowed", default=False)


@dataclass
class PollingWait(Generic[T]):
    """Look until `is_done(value)` or `deadline` (time.monotonic()), sleeping `delays`
    between looks. The value is the last look's, whether done or not."""

    look: Callable[[], T]
    is_done: Callable[[T], bool]
    delays: Iterator[float]
    deadline: float

    def blocking(self, first: T) -> T:
        value = first
        while True:
            remaining = self.deadline - time.monotonic()
            if self.is_done(value) or remaining <= 0:
                return value
            time.sleep(min(next(self.delays), remaining))
            value = self.look()

    async def asleep(self, first: T, run_sync: Callable[[Callable[[], T]], Awaitable[T]]) -> T:
        """The same loop with the sleeps on the event loop; each look runs via `run_sync`."""
        value = first
        while True:
            remaining = self.deadline - time.monotonic()
            if self.is_done(value) or remaining <= 0:
                return value
            await asyncio.sleep(min(next(self.delays), remaining))
            value = await run_sync(self.look)


class Handoff(Exception):
    """A wait handed to the caller, with what is left to do once it ends (`resume`)."""

    def __init__(self, wait: PollingWait[Any], first: Any) -> None:
        super().__init__("wait handed to the caller")
        self.wait = wait
        self.first = first
        self.resume: Callable[[Any], Any] = lambda value: value

    def then(self, after: Callable[[Any], Any]) -> Handoff:
        """`after(result)` runs on what the work left so far returns."""
        inner = self.resume
        self.resume = lambda value: after(inner(value))
        return self

    def around(self, wrapper: Callable[[Callable[[], Any]], Any]) -> Handoff:
        """`wrapper(run)` runs the work left so far as `run()`: a try/except or a scope
        that wrapped the wait wraps what follows it the same way."""
        inner = self.resume
        self.resume = lambda value: wrapper(lambda: inner(value))
        return self

    async def complete(
        self,
        *,
        look: Callable[[Callable[[], Any]], Awaitable[Any]],
        rest: Callable[[Callable[[], Any]], Awaitable[Any]],
    ) -> Any:
        """Wait on the event loop (each look run by `look`), then run what is left (by
        `rest`: in a thread) and return what it returns."""
        value = await self.wait.asleep(self.first, look)
        resume = self.resume
        return await rest(lambda: resume(value))


def polling_wait(wait: PollingWait[T]) -> T:
    """Look once; if not done, hand the wait to the caller when it asked, else block."""
    first = wait.look()
    if (
        _CALLER_COMPLETES.get()
        and _ALLOWED.get()
        and not wait.is_done(first)
        and wait.deadline > time.monotonic()
    ):
        raise Handoff(wait, first)
    return wait.blocking(first)


@contextmanager
def waits_handed_off() -> Generator[None]:
    """Inside: the caller is an event loop that completes a Handoff raised to it."""
    token = _CALLER_COMPLETES.set(True)
    try:
        yield
    finally:
        _CALLER_COMPLETES.reset(token)


@contextmanager
def handoff_allowed(allowed: bool = True) -> Generator[None]:
    """Inside: a polling wait may be handed off (if the caller completes handoffs); every
    layer from here to that caller must pass a Handoff on with its own rest added.
    `allowed=False`: no wait inside is handed off (work after a handed-off wait's point)."""
    token = _ALLOWED.set(allowed)
    try:
        yield
    finally:
        _ALLOWED.reset(token)
