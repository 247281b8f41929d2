"""Polling helpers for tests that watch real processes: bounded, never a bare sleep-and-hope."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T | None],
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
    message: str = "condition",
) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_server(port: int) -> subprocess.Popen[bytes]:
    """A private redis-server keeping nothing on disk: tests may kill it; the machine's
    Redis, which other runs share, is never touched."""
    process = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    wait_for(
        lambda: (
            subprocess.run(
                ["redis-cli", "-p", str(port), "ping"], capture_output=True, check=False
            ).stdout.strip()
            == b"PONG"
        ),
        timeout=10,
        message="redis",
    )
    return process
