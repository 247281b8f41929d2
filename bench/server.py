"""Serve the app as production does, for the length of a benchmark, and measure its CPU.

gunicorn with config/gunicorn.py (gthread, one process per core, 8 threads each, persistent
database connections) on the bench settings (bench/settings.py: production's, plus the
anchor URLs). One change, by environment: no worker recycling. `max_requests` bounds a
slow leak in production; at bench rates it would restart each worker every few seconds and
put fork-and-import time into both sides of every ratio.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes so far (processes gone since count nothing)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / CLOCK_TICKS


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def pids(self) -> list[int]:
        return [self.process.pid, *children(self.process.pid)]


@contextmanager
def gunicorn(log_dir: Path, workers: int | None = None) -> Iterator[Server]:
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "gunicorn.log"
    env = {
        **os.environ,
        "GUNICORN_BIND": f"127.0.0.1:{port}",
        "GUNICORN_MAX_REQUESTS": "0",
        "DJANGO_SETTINGS_MODULE": "bench.settings",
    }
    if workers:
        env["GUNICORN_WORKERS"] = str(workers)
    with log_path.open("wb") as log:  # this run's log only
        process = subprocess.Popen(
            [str(BIN / "gunicorn"), "-c", "python:config.gunicorn"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(process, f"http://127.0.0.1:{port}", log_path)
    try:
        _wait_ready(
            server, expected=workers or int(env.get("GUNICORN_WORKERS", os.cpu_count() or 2))
        )
        yield server
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _wait_ready(server: Server, expected: int, timeout: float = 90.0) -> None:
    """Until every worker has booted: /healthz answers, and the master has its workers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"gunicorn exited:\n{server.log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{server.url}/healthz", timeout=1) as answer:  # noqa: S310
                json.load(answer)
            if len(children(server.process.pid)) >= expected:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"gunicorn did not start:\n{server.log_path.read_text()[-4000:]}")
