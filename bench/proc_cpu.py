"""Where the CPU of a measured window went: CPU seconds per process group, read from /proc.

A group is known by its command line (the server's gunicorn and uvicorn processes, the
Celery worker, PostgreSQL, anvil), the bench process itself (the agents, or the bare
broadcaster's senders) and everything else on the machine ("other": another session's
tests on a shared machine). Read before and after a window; only processes alive at both
reads count, so start the reading after the servers are up and end it before they stop.
Linux only: elsewhere the reading is empty.
"""

from __future__ import annotations

import os
from pathlib import Path

GROUPS = ("router", "server", "worker", "postgresql", "chain", "agents", "other")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _group(pid: int, cmdline: str) -> str:
    if pid == os.getpid():
        return "agents"
    if "celery" in cmdline:
        return "worker"
    if "demo_router" in cmdline:  # the demo's balancer in one process (devtools/demo_router.py)
        return "router"
    if "gunicorn" in cmdline or "uvicorn" in cmdline or "sdk_seller" in cmdline:
        return "server"
    if cmdline.startswith("postgres") or "/postgres" in cmdline.split(" ", 1)[0]:
        return "postgresql"
    if "anvil" in cmdline.split(" ", 1)[0]:
        return "chain"
    return "other"


def cpu_reading() -> dict[int, tuple[str, float]]:
    """Every process's (group, CPU seconds so far, all its threads), by pid."""
    reading: dict[int, tuple[str, float]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return reading
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone between the listing and the read
        # The fields after the command name (which may hold spaces) in its parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        utime, stime = int(fields[11]), int(fields[12])
        pid = int(entry.name)
        reading[pid] = (_group(pid, cmdline.strip()), (utime + stime) / _TICKS)
    return reading


def cpu_spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
              ) -> dict[str, float]:  # fmt: skip
    """CPU seconds per group between two readings (processes present in both)."""
    spent = dict.fromkeys(GROUPS, 0.0)
    for pid, (group, seconds) in after.items():
        if pid in before and before[pid][0] == group:
            spent[group] += max(0.0, seconds - before[pid][1])
    return spent


def cpu_per_call(spent: dict[str, float], calls: int) -> str:
    """'server 21.3, postgresql 6.0, ... ms per call' (the groups that spent anything)."""
    if not calls:
        return "no calls"
    parts = [f"{group} {spent[group] * 1000 / calls:.1f}" for group in GROUPS if spent[group]]
    return ", ".join(parts) + " ms CPU per call"
