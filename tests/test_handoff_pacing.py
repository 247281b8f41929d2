"""core.handoff's paced waits on an event loop: one watcher per loop and key wakes the waits
when the paced value changes (the chain-backed version: tests/x402/test_x402_head_watch.py).

The looks are plain functions over a value the test moves (a head), run in real threads as
the paid URL runs them; nothing here is timed but the waits' own deadlines."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from core.handoff import Pacing, PollingWait, pacing_watched


async def in_thread(work: Callable[[], Any]) -> Any:
    return await asyncio.to_thread(work)


class Chain:
    """A head the test moves, and counts of who looked at it."""

    def __init__(self) -> None:
        self.head = 0
        self.head_looks = 0
        self.fail = False
        self.lock = threading.Lock()

    def look_head(self) -> int:
        with self.lock:
            self.head_looks += 1
            if self.fail:
                raise OSError("node unreachable")
            return self.head

    def pacing(self, key: str = "node", ceiling: float = 60.0) -> Pacing:
        return Pacing(key=key, look=self.look_head, interval=0.005, ceiling=ceiling)


class Wait:
    """A wait done once the head reaches `until`, counting its own looks (each taking
    `look_seconds`: a slow node, a busy pool)."""

    def __init__(
        self,
        chain: Chain,
        until: int,
        pacing: Pacing,
        deadline: float = 60.0,
        look_seconds: float = 0.0,
    ) -> None:
        self.chain, self.looks, self.look_seconds = chain, 0, look_seconds
        self.polling = PollingWait(
            look=self.look,
            is_done=lambda head: head >= until,
            delays=iter(()),  # a paced wait never takes a timed sleep
            deadline=time.monotonic() + deadline,
            pacing=pacing,
        )

    def look(self) -> int:
        self.looks += 1
        head = self.chain.head
        time.sleep(self.look_seconds)
        return head

    async def run(self) -> int:
        looked_at = time.monotonic()
        first = self.look()
        return await self.polling.asleep(first, in_thread, looked_at=looked_at)


async def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


def test_waits_look_once_per_change_share_one_watcher_that_ends_with_them() -> None:
    chain = Chain()

    async def scenario() -> None:
        waits = [Wait(chain, until=2, pacing=chain.pacing()) for _ in range(5)]
        other = Wait(chain, until=1, pacing=chain.pacing("another node"))
        tasks = [asyncio.create_task(w.run()) for w in [*waits, other]]
        await until(lambda: chain.head_looks >= 20)
        assert sorted(map(str, pacing_watched())) == ["another node", "node"]  # one per key
        # Begun before the watcher's first look: one more look each, at that head; no more.
        assert [w.looks for w in waits] == [2] * 5

        chain.head = 1  # a block that is not theirs: one look each, right after it
        await until(lambda: other.looks == 3)
        await until(lambda: chain.head_looks >= 60)
        assert [w.looks for w in waits] == [3] * 5

        chain.head = 2
        assert await asyncio.gather(*tasks) == [2] * 5 + [1]
        assert [w.looks for w in waits] == [4] * 5
        await until(lambda: pacing_watched() == [])  # nothing waits: no watcher left

    asyncio.run(scenario())


def test_a_wait_begun_after_the_head_was_seen_sleeps_until_it_moves() -> None:
    chain = Chain()

    async def scenario() -> None:
        early = asyncio.create_task(Wait(chain, until=1, pacing=chain.pacing()).run())
        await until(lambda: chain.head_looks >= 3)  # the watcher has seen head 0
        late = Wait(chain, until=1, pacing=chain.pacing())
        task = asyncio.create_task(late.run())
        await until(lambda: chain.head_looks >= 40)
        assert late.looks == 1  # its own first look only
        chain.head = 1
        assert await asyncio.gather(early, task) == [1, 1]
        assert late.looks == 2

    asyncio.run(scenario())


def test_a_lone_wait_with_slow_looks_keeps_its_watcher_between_them() -> None:
    # Looks slower than the watcher's interval: the watcher must not end while the wait is
    # looking, else each new watcher's first head would wake the wait again, and again.
    chain = Chain()

    async def scenario() -> None:
        wait = Wait(chain, until=1, pacing=chain.pacing(), look_seconds=0.03)
        task = asyncio.create_task(wait.run())
        await until(lambda: chain.head_looks >= 60)
        assert wait.looks == 2  # its first, and once at the first head the watcher saw
        chain.head = 1
        assert await task == 1
        assert wait.looks == 3

    asyncio.run(scenario())


def test_a_failing_head_look_wakes_nobody_and_a_wait_still_looks_by_its_ceiling() -> None:
    chain = Chain()
    chain.fail = True

    async def scenario() -> None:
        stuck = Wait(chain, until=1, pacing=chain.pacing(ceiling=0.05), deadline=30.0)
        paced = Wait(chain, until=1, pacing=chain.pacing("other", ceiling=60.0))
        stuck_task = asyncio.create_task(stuck.run())
        paced_task = asyncio.create_task(paced.run())
        await until(lambda: chain.head_looks >= 40)
        assert paced.looks == 1  # a failed look is no change
        chain.head = 1  # seen only by the waits' own looks while the head look fails
        assert await stuck_task == 1  # looked by its ceiling (its deadline is far off)
        assert not paced_task.done()
        chain.fail = False
        assert await paced_task == 1

    asyncio.run(scenario())


def test_a_wait_never_sleeps_past_its_deadline_and_the_blocking_wait_ignores_pacing() -> None:
    chain = Chain()

    async def scenario() -> int:
        wait = Wait(chain, until=1, pacing=chain.pacing(ceiling=60.0), deadline=0.2)
        return await wait.run()

    assert asyncio.run(scenario()) == 0  # not done: the last look's value, at the deadline

    looks_before = chain.head_looks
    blocking = PollingWait(
        look=lambda: chain.head,
        is_done=lambda head: head >= 1,
        delays=iter([0.001] * 1000),
        deadline=time.monotonic() + 0.05,
        pacing=chain.pacing(),
    )
    assert blocking.blocking(0) == 0
    assert chain.head_looks == looks_before  # timed sleeps, no watcher
