"""Waits for something outside the database (a receipt, a block), as values.

A paid request that waits for its block spends almost all its time asleep between cheap
looks at the chain. Synchronous code cannot sleep without its thread; so the code that
starts such a wait looks once and, if the wait is not over, returns it as a value
(`Awaiting`: the wait, its first look, when that look began) instead of sleeping. Whoever
holds the value decides how to sleep: `blocking()` on its own thread (a resubmission, a
reconciliation, a synchronous server), or `ended(run_sync)` on an event loop, each look a
short hop to a thread (doors.x402.paid_async), and then carries on with the value the wait
ended on. Nothing is raised and nothing is held across the wait: no transaction is open
around a network wait (the settlement's rule), and the caller re-enters what it needs.

On the event loop a wait may be paced by something cheaper than its own look (`Pacing`: a
chain's head). Then it does not sleep on its own timer: one watcher per event loop and
pacing key looks at that value every `interval` seconds while any wait is paced by it, and
wakes them all when it changes, so a hundred payments waiting for the same block look for
their receipts once each, right after it, instead of each on its own schedule. The watcher
ends when nothing waits on it; a look of its that fails wakes nobody; a wait still looks at
least every `ceiling` seconds (a watcher that cannot see) and never sleeps past its
deadline. The blocking wait keeps its timed sleeps.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pacing:
    """What tells a wait on an event loop when to look again: `look` (run like the wait's
    own looks, in a thread) answers a value that changes when a look may find something new.
    Waits with equal `key` on one event loop share one watcher, which looks every
    `interval` seconds while any of them waits; a wait looks at least every `ceiling`."""

    key: Hashable
    look: Callable[[], Hashable]
    interval: float
    ceiling: float
    # After a change the watcher does not look for this fraction of the shortest of the
    # last gaps between changes it saw (a chain's block time): 0.75 at 2-second blocks
    # looks about 10 times a block, not 40. 0: it looks every `interval` throughout.
    quiet: float = 0.0


@dataclass
class PollingWait(Generic[T]):
    """Look until `is_done(value)` or `deadline` (time.monotonic()), sleeping `delays`
    between looks. The value is the last look's, whether done or not. With `pacing`, a wait
    on an event loop sleeps until the paced value changes instead (`asleep`)."""

    look: Callable[[], T]
    is_done: Callable[[T], bool]
    delays: Iterator[float]
    deadline: float
    pacing: Pacing | None = None

    def blocking(self, first: T) -> T:
        value = first
        while True:
            remaining = self.deadline - time.monotonic()
            if self.is_done(value) or remaining <= 0:
                return value
            time.sleep(min(next(self.delays), remaining))
            value = self.look()

    async def asleep(
        self,
        first: T,
        run_sync: Callable[[Callable[[], Any]], Awaitable[Any]],
        *,
        looked_at: float = -math.inf,
    ) -> T:
        """The same loop with the sleeps on the event loop; each look runs via `run_sync`.
        `looked_at`: when the look that gave `first` began (unknown: any change wakes)."""
        value = first
        if self.is_done(value) or self.deadline <= time.monotonic():
            return value
        async with _watching(self.pacing, run_sync) as watcher:
            while True:
                remaining = self.deadline - time.monotonic()
                if self.is_done(value) or remaining <= 0:
                    return value
                if self.pacing is None or watcher is None:
                    await asyncio.sleep(min(next(self.delays), remaining))
                else:
                    timeout = min(self.pacing.ceiling, remaining)
                    await watcher.sleep(looked_at=looked_at, timeout=timeout)
                looked_at = time.monotonic()
                value = await run_sync(self.look)


class _Watcher:
    """Looks at one paced value for one event loop while any wait is paced by it.

    `changed_at` is when the look that saw the latest change ended: a block it saw may be
    newer than a wait's own look only if that look began before then, so such a wait looks
    again at once and a later one sleeps until the next change. The first value a watcher
    sees counts as a change (what came before it is unknown). A wait holds the watcher from
    its first sleep to its end, its looks included, so a watcher does not end and start
    again (and wake it again) between one wait's looks."""

    def __init__(self, slot: tuple[asyncio.AbstractEventLoop, Hashable], pacing: Pacing,
                 run_sync: Callable[[Callable[[], Any]], Awaitable[Any]]) -> None:  # fmt: skip
        self.slot = slot
        self.pacing = pacing
        self.run_sync = run_sync
        self.value: Hashable = _UNSEEN
        self.changed_at = -math.inf
        self.changed = asyncio.Event()
        self.waits = 0
        self.failing = False
        self.gaps: deque[float] = deque(maxlen=_GAPS_KEPT)  # between changes seen in a row
        self.task = slot[0].create_task(self._watch(), name="pacing watcher")
        self.task.add_done_callback(self._forget)

    async def sleep(self, *, looked_at: float, timeout: float) -> None:
        """Until the value may have changed since a look that began at `looked_at`, or
        `timeout` seconds."""
        if self.changed_at > looked_at:
            return
        changed = self.changed
        try:
            async with asyncio.timeout(timeout):
                await changed.wait()
        except TimeoutError:
            pass

    async def _watch(self) -> None:
        # Ends once a look and an interval pass with no wait paced by it (the next wait
        # starts another watcher), so no task is left looking for nobody.
        while self.waits:
            try:
                value = await self.run_sync(self.pacing.look)
            except Exception as exc:  # a look that failed saw nothing: wake nobody
                if not self.failing:
                    logger.warning(
                        "pacing look failed; waits look on their own at least every %s s "
                        "until it answers: %r", self.pacing.ceiling, exc,
                    )  # fmt: skip
                self.failing = True
            else:
                self.failing = False
                if value != self.value:
                    self._change(value)
            await asyncio.sleep(max(self.pacing.interval, self._quiet_left()))

    def _change(self, value: Hashable) -> None:
        now = time.monotonic()
        if self.value is not _UNSEEN and self.changed_at > -math.inf:
            self.gaps.append(now - self.changed_at)
        self.value, self.changed_at = value, now
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    def _quiet_left(self) -> float:
        """How long no change is expected: `quiet` of the shortest recent gap, from the
        last change. Only once the last gaps keep a clock (none more than half as long
        again as the shortest): a chain's block time is learnt, never assumed, and changes
        that come when they please (automine, blocks on demand) are looked for throughout.
        A change sooner than expected is seen late by at most the waits' ceiling."""
        if not self.pacing.quiet or len(self.gaps) < _GAPS_KEPT:
            return 0.0
        if max(self.gaps) > _CLOCK_SPREAD * min(self.gaps):
            return 0.0
        quiet_until = self.changed_at + self.pacing.quiet * min(self.gaps)
        return quiet_until - time.monotonic()

    def _forget(self, _task: asyncio.Task[None]) -> None:
        if _WATCHERS.get(self.slot) is self:
            del _WATCHERS[self.slot]


_UNSEEN: Hashable = object()
# The gaps between changes a watcher learns its quiet period from.
_GAPS_KEPT = 3
_CLOCK_SPREAD = 1.5
# The running watchers of this process, by (event loop, pacing key); each removes itself.
_WATCHERS: dict[tuple[asyncio.AbstractEventLoop, Hashable], _Watcher] = {}


@asynccontextmanager
async def _watching(
    pacing: Pacing | None, run_sync: Callable[[Callable[[], Any]], Awaitable[Any]]
) -> AsyncIterator[_Watcher | None]:
    """The running watcher for `pacing` on this event loop (started if none), held inside."""
    if pacing is None:
        yield None
        return
    slot = (asyncio.get_running_loop(), pacing.key)
    watcher = _WATCHERS.get(slot)
    if watcher is None or watcher.task.done():
        watcher = _WATCHERS[slot] = _Watcher(slot, pacing, run_sync)
    watcher.waits += 1
    try:
        yield watcher
    finally:
        watcher.waits -= 1


def pacing_watched() -> list[Hashable]:
    """The pacing keys a watcher looks at now, in any event loop of this process."""
    return [key for _loop, key in list(_WATCHERS)]


@dataclass(frozen=True)
class Awaiting(Generic[T]):
    """A wait that was not over at its first look, handed back as a value: sleep through
    it with `blocking()` or, on an event loop, `await ended(run_sync)`; either gives the
    value it ended on (done, or the last look's at the deadline)."""

    wait: PollingWait[T]
    first: T
    looked_at: float  # when the look that gave `first` began (time.monotonic())

    def blocking(self) -> T:
        return self.wait.blocking(self.first)

    async def ended(self, run_sync: Callable[[Callable[[], Any]], Awaitable[Any]]) -> T:
        return await self.wait.asleep(self.first, run_sync, looked_at=self.looked_at)

    def map(self, then: Callable[[T], T]) -> Awaiting[T]:
        """The same wait, every value it gives passed through `then` (evidence added to
        each look, say): `then` must not change whether a value is done."""
        wait = self.wait
        mapped = replace(wait, look=lambda: then(wait.look()))
        return Awaiting(mapped, then(self.first), self.looked_at)


def look_once(wait: PollingWait[T]) -> T | Awaiting[T]:
    """Look once: the value if the wait is over (done, or its deadline passed), else the
    wait as a value for the caller to sleep through."""
    looked_at = time.monotonic()
    first = wait.look()
    if wait.is_done(first) or wait.deadline <= time.monotonic():
        return first
    return Awaiting(wait, first, looked_at)


def waited_out(value: T | Awaiting[T]) -> T:
    """The value, sleeping on this thread through a wait if it is one."""
    return value.blocking() if isinstance(value, Awaiting) else value
