"""What every benchmark returns: figures as ratios against an anchor measured in the same run.

A benchmark module exposes `run(scale: Scale) -> list[Figure]`. The runner (bench/run.py)
prints one table of every figure (min / median / max over the repeats) and the goal.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from enum import StrEnum


class Scale(StrEnum):
    SMOKE = "smoke"  # CI: tiny sizes, one repeat; proves the bench still runs
    FULL = "full"  # the figures docs/benchmarks.md records


@dataclass(frozen=True)
class Figure:
    """One line of the table: a ratio of ours against its anchor, over repeated runs.

    `ratios` holds one value per repeat. `goal` is the documented target (for example
    ">= 2.0" for a throughput ratio, "<= 0.5" for a latency ratio); `detail` carries the
    absolute numbers the ratios came from, so a reader can check them.
    """

    name: str
    ratios: list[float]
    goal: str = ""
    detail: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def minimum(self) -> float:
        return min(self.ratios)

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def maximum(self) -> float:
        return max(self.ratios)

    def meets_goal(self) -> bool | None:
        """None when there is no goal; judged on the median."""
        if not self.goal:
            return None
        op, _, bound = self.goal.partition(" ")
        value = float(bound)
        return self.median >= value if op == ">=" else self.median <= value
