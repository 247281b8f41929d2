"""Polling helpers for tests that watch real processes: bounded, never a bare sleep-and-hope."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from django.db import connection

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


def race(count: int, send: Callable[[int], T], *, timeout: float = 120.0) -> list[T]:
    """Release `count` calls of `send(i)` at once from real threads; their results, in order.

    Each thread closes its own database connection; an exception in a thread is re-raised
    here, so a racer that crashed can never pass for one that lost.
    """
    barrier = threading.Barrier(count)
    answers: list[T | None] = [None] * count
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=timeout)
            answers[i] = send(i)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    if errors:
        raise errors[0]
    assert all(answer is not None for answer in answers), "every racer finished"
    return [answer for answer in answers if answer is not None]
