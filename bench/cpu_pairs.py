"""CPU per paid x402 request, two trees measured in paired rounds (issue 20's rule: a change
may not grow it more than 10%).

Each round runs bench/by_hand/profile_paid_request.py (tests/x402/ in a tree from before it
moved; the suite's fixtures, a real anvil, PostgreSQL; the median CPU of this process per
request, after its warm-up) in both trees at the same time, so a shared machine's load falls
on both sides alike (`--sequential`: one after the other, the order swapped every round; on a
machine others load unevenly that favoured whichever side ran in the quieter minutes). The
figure is the median of the per-round ratios after/before, with both sides' medians:

    DATABASE_URL=postgres://.../db REDIS_URL=redis://... .venv/bin/python bench/cpu_pairs.py \\
        --before /path/to/base/worktree --after . --rounds 9 --requests 20

Each tree runs on its own database (DATABASE_URL's name with `_a` / `_b` appended), kept
between rounds (`--reuse-db`, as the earlier runs passed by hand through PYTEST_ADDOPTS). The
402s of a round are all asked before its clock starts, so on a loaded machine the first may
expire before it is paid: the anonymous quote's lifetime is stretched to an hour
(X402_ANONYMOUS_QUOTE_TTL_SECONDS, unless set). A round whose profile failed on a passing
trouble of the shared machine (PostgreSQL's "too many clients", a deadline) is run again, up
to `--retries` times, and said so.
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
# The profiler, where each tree has it: trees from before it moved to bench/ hold it in tests/.
PROFILES = ("bench/by_hand/profile_paid_request.py", "tests/x402/profile_paid_request.py")
# What a loaded, shared machine does to a round now and then; anything else stops the run.
PASSING = ("too many clients", "remaining connection slots", "quote_expired", "Timeout")


class RoundFailed(Exception):
    def __init__(self, tree: Path, output: str, *, passing: bool) -> None:
        super().__init__(f"{tree}: the profile failed\n{output}")
        self.passing = passing


def start(tree: Path, database_url: str, requests: int) -> subprocess.Popen[str]:
    env = {**os.environ, "DATABASE_URL": database_url, "PROFILE_REQUESTS": str(requests)}
    env["PROFILE_TOP"] = "0"
    env["PROFILE_CPROFILE"] = "0"  # the figure is the plain half; the trees need not profile
    env.setdefault("X402_ANONYMOUS_QUOTE_TTL_SECONDS", "3600")
    if "--reuse-db" not in env.get("PYTEST_ADDOPTS", ""):
        env["PYTEST_ADDOPTS"] = f"{env.get('PYTEST_ADDOPTS', '')} --reuse-db".strip()
    return subprocess.Popen(
        [
            str(tree / ".venv/bin/python"),
            "-m",
            "pytest",
            next(profile for profile in PROFILES if (tree / profile).is_file()),
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
        output = f"{stdout[-3000:]}\n{stderr[-3000:]}"
        raise RoundFailed(tree, output, passing=any(word in output for word in PASSING))
    return float(found.group(1))


def one_round(
    trees: dict[str, tuple[Path, str]], order: tuple[str, str], requests: int, sequential: bool
) -> dict[str, float]:
    if sequential:
        return {side: result(trees[side][0], start(*trees[side], requests)) for side in order}
    running = {side: start(*trees[side], requests) for side in order}
    figures: dict[str, float] = {}
    failed: RoundFailed | None = None
    for side in order:  # wait for both, whatever the first did
        try:
            figures[side] = result(trees[side][0], running[side])
        except RoundFailed as error:
            failed = failed or error
    if failed is not None:
        raise failed
    return figures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--sequential", action="store_true")
    parser.add_argument(
        "--retries", type=int, default=2, help="reruns of a round failed by the machine's load"
    )
    args = parser.parse_args()
    url = os.environ["DATABASE_URL"]
    trees = {
        "before": (args.before.resolve(), url + "_a"),
        "after": (args.after.resolve(), url + "_b"),
    }
    figures: dict[str, list[float]] = {"before": [], "after": []}
    for n in range(args.rounds):
        order = ("before", "after") if n % 2 == 0 else ("after", "before")
        for retry in range(args.retries + 1):
            try:
                got = one_round(trees, order, args.requests, args.sequential)
                break
            except RoundFailed as error:
                if not error.passing or retry == args.retries:
                    sys.exit(str(error))
                print(f"round {n + 1}: failed on the machine's load, again", flush=True)
        for side in order:
            figures[side].append(got[side])
        before, after = figures["before"][-1], figures["after"][-1]
        print(
            f"round {n + 1}: before {before:.2f} ms, after {after:.2f} ms "
            f"(load average {os.getloadavg()[0]:.1f})",
            flush=True,
        )
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
