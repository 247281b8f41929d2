"""What the in-process profilers (bench/by_hand/profile_*.py) print: our functions, not Django's."""

from __future__ import annotations

import os
import pstats
from pathlib import Path

OURS = ("doors/", "backoffice/", "purchases/", "payments/", "core/", "fulfillment/")
ROOT = Path(__file__).resolve().parents[2]


def print_ours(stats: pstats.Stats, top: int) -> None:
    """Our functions by cumulative time, as a share of everything profiled."""
    rows = []
    for (filename, line, name), (_cc, calls, _tt, cumulative, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        relative = os.path.relpath(filename, ROOT)
        if relative.startswith(OURS):
            rows.append((cumulative, calls, f"{relative}:{line}::{name}"))
    rows.sort(reverse=True)
    total = stats.total_tt  # type: ignore[attr-defined]
    print(f"our functions by cumulative share of {total * 1e3:.0f} ms profiled:")
    for cumulative, calls, where in rows[:top]:
        print(f"  {cumulative / total:6.1%}  {calls:6d} calls  {where}")
