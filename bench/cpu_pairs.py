"""CPU per paid x402 request, two trees measured in paired rounds (issue 20's rule: a change
may not grow it more than 10%).

Each round runs tests/x402/profile_paid_request.py (the suite's fixtures, a real anvil,
PostgreSQL; the median CPU of this process per request, after its warm-up) in both trees at
the same time, so a shared machine's load falls on both sides alike (`--sequential`: one
after the other, the order swapped every round; on a machine others load unevenly that
favoured whichever side ran in the quieter minutes). The figure is the median of the
per-round ratios after/before, with both sides' medians:

    DATABASE_URL=postgres://.../db REDIS_URL=redis://... .venv/bin/python bench/cpu_pairs.py \\
        --before /path/to/base/worktree --after . --rounds 9 --requests 20

Each tree runs on its own database (DATABASE_URL's name with `_a` / `_b` appended).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

PLAIN = re.compile(r"plain\s+n=\d+\s+median ([\d.]+)")


def start(tree: Path, database_url: str, requests: int) -> subprocess.Popen[str]:
    env = {**os.environ, "DATABASE_URL": database_url, "PROFILE_REQUESTS": str(requests)}
    env["PROFILE_TOP"] = "0"
    return subprocess.Popen(
        [
            str(tree / ".venv/bin/python"),
            "-m",
            "pytest",
            "tests/x402/profile_paid_request.py",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
        ],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result(tree: Path, running: subprocess.Popen[str]) -> float:
    stdout, stderr = running.communicate()
    found = PLAIN.search(stdout)
    if running.returncode or not found:
        sys.exit(f"{tree}: the profile failed\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return float(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--sequential", action="store_true")
    args = parser.parse_args()
    url = os.environ["DATABASE_URL"]
    trees = {
        "before": (args.before.resolve(), url + "_a"),
        "after": (args.after.resolve(), url + "_b"),
    }
    figures: dict[str, list[float]] = {"before": [], "after": []}
    for n in range(args.rounds):
        order = ("before", "after") if n % 2 == 0 else ("after", "before")
        if args.sequential:
            for side in order:
                tree, url = trees[side]
                figures[side].append(result(tree, start(tree, url, args.requests)))
        else:
            running = {side: start(*trees[side], args.requests) for side in order}
            for side in order:
                figures[side].append(result(trees[side][0], running[side]))
        before, after = figures["before"][-1], figures["after"][-1]
        print(f"round {n + 1}: before {before:.2f} ms, after {after:.2f} ms", flush=True)
    ratios = [a / b for a, b in zip(figures["after"], figures["before"], strict=True)]
    print(
        f"CPU per paid x402 request (median of {args.rounds} rounds, ms): "
        f"before {statistics.median(figures['before']):.2f}, "
        f"after {statistics.median(figures['after']):.2f}; "
        f"after/before median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
