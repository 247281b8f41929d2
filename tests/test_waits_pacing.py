"""core.waits's paced waits on an event loop: one watcher per loop and key wakes the waits
when the paced value changes (the chain-backed version: tests/x402/test_x402_head_watch.py).

The looks are plain functions over a value the test moves (a head), run in real threads as
the paid URL runs them; nothing here is timed but the waits' own deadlines."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from core.waits import Pacing, PollingWait, pacing_watched


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


class Clock:
    """Moves the chain's head by itself, one block every `gaps` entry in turn (a chain's
    clock when they are equal, blocks on demand when not), counting the watcher's looks
    between blocks once the first `learn` blocks have passed."""

    def __init__(self, chain: Chain, gaps: list[float], blocks: int, learn: int = 4) -> None:
        self.chain, self.gaps, self.blocks, self.learn = chain, gaps, blocks, learn
        self.looks_at_learnt = 0

    async def run(self) -> None:
        for block in range(1, self.blocks + 1):
            await asyncio.sleep(self.gaps[block % len(self.gaps)])
            if block == self.learn:
                self.looks_at_learnt = self.chain.head_looks
            self.chain.head = block

    def looks_per_block_after_learning(self) -> float:
        return (self.chain.head_looks - self.looks_at_learnt) / (self.blocks - self.learn)


def _looks_per_block(gaps: list[float], quiet: float) -> float:
    """One wait for the 12th block, its watcher looking every 5 ms but for `quiet` of the
    learnt block time after each block; the watcher's looks per block once it had learnt."""
    chain = Chain()
    clock = Clock(chain, gaps, blocks=12)
    pacing = Pacing(key="node", look=chain.look_head, interval=0.005, ceiling=60.0, quiet=quiet)
    wait = Wait(chain, until=12, pacing=pacing)

    async def scenario() -> None:
        ticking = asyncio.create_task(clock.run())
        assert await wait.run() == 12  # every block seen: the last one ends the wait
        await ticking

    asyncio.run(scenario())
    # The wait itself looked once per block (plus its first look and the catch-up look).
    assert wait.looks <= 12 + 2
    return clock.looks_per_block_after_learning()


def test_a_watcher_on_a_chains_clock_stops_looking_for_most_of_the_block_time() -> None:
    every_block = _looks_per_block([0.2], quiet=0.0)
    quiet = _looks_per_block([0.2], quiet=0.75)
    # 0.75 of the block time without a look: about a quarter of the looks (0.3 to spare for
    # a loaded machine, where each look takes longer and both sides look less).
    assert quiet < 0.55 * every_block, (quiet, every_block)


def test_blocks_that_keep_no_clock_are_looked_for_throughout() -> None:
    # Blocks on demand (automine, a bursty chain): gaps of 0.05 s and 0.3 s are no clock,
    # so the watcher never goes quiet and looks as often as one without a quiet period.
    uneven = [0.05, 0.3]
    every_block = _looks_per_block(uneven, quiet=0.0)
    quiet = _looks_per_block(uneven, quiet=0.75)
    assert quiet > 0.7 * every_block, (quiet, every_block)
