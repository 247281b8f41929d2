"""How often a broadcast looks for its receipt: at once, then closer to the chain's pace.

A fixed 0.25 s sleep made every settlement on a fast chain (anvil with automine, a rollup
sequencer that confirms in tens of milliseconds) wait a whole interval for a receipt that was
there a few milliseconds after the send. The first looks come quickly and the gaps double up
to the settler's interval, so a slow chain costs a handful of extra cheap reads per
settlement, never a faster steady rate.
"""

from __future__ import annotations

from collections.abc import Iterator

FIRST_LOOK_SECONDS = 0.005
GROWTH = 2.0


def receipt_poll_delays(*, ceiling: float, first: float = FIRST_LOOK_SECONDS) -> Iterator[float]:
    """Sleeps between receipt look-ups: `first`, doubling, then `ceiling` for ever."""
    delay = min(first, ceiling)
    while True:
        yield delay
        delay = min(delay * GROWTH, ceiling)
