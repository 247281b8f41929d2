"""The receipt look-ups of a broadcast start fast and slow down to the settler's interval."""

from __future__ import annotations

import itertools

from payments.rails.x402.receipts import receipt_poll_delays


def test_first_looks_come_fast_then_double_up_to_the_ceiling_and_stay() -> None:
    delays = list(itertools.islice(receipt_poll_delays(ceiling=0.25, first=0.005), 9))
    assert delays == [0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.25, 0.25, 0.25]


def test_a_ceiling_below_the_first_look_wins() -> None:
    assert list(itertools.islice(receipt_poll_delays(ceiling=0.001), 3)) == [0.001] * 3
