"""bench/delay_proxy.py and its C build (bench/delay_proxy.c), the latency between hosts
in `make bench-hosts`, on real sockets: every test runs against both.

The whole bench (network namespaces, two web hosts, two worker hosts, a host cut off
mid-load) needs root and takes minutes, so CI runs only this; the smoke run of the bench
is `sudo .venv/bin/python bench/hosts.py --scale smoke` (docs/deployment.md).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.delay_proxy import command, native_binary

ROOT = Path(__file__).resolve().parents[1]
DELAY = 0.08  # each way: well above a loaded machine's scheduling noise


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Upstream:
    """An echo server that also records what it received; `hang_up` closes after reading."""

    def __init__(self, hang_up: bool = False) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.hang_up = hang_up
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                self.received += data
                if self.hang_up:
                    break
                conn.sendall(data)


@pytest.fixture(params=["c", "python"])
def native(request: pytest.FixtureRequest) -> bool:
    if request.param == "c" and native_binary() is None:
        pytest.skip("no C compiler: the bench runs the Python proxy")
    return bool(request.param == "c")


def _proxy(target_port: int, delay: float, native: bool) -> Iterator[int]:
    port = _free_port()
    link = f"127.0.0.1:{port}=127.0.0.1:{target_port}"
    process = subprocess.Popen(
        command(delay * 1000, [link], native=native),
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "delay proxy ready"
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def echo() -> Upstream:
    return Upstream()


@pytest.fixture
def proxied(echo: Upstream, native: bool) -> Iterator[int]:
    yield from _proxy(echo.port, DELAY, native)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return bytes(data)


def test_bytes_pass_intact_both_ways(echo: Upstream, proxied: int) -> None:
    payload = os.urandom(3 * 1024 * 1024)  # many chunks, in order
    with _connect(proxied) as sock:
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        back = _read(sock, len(payload))
        sender.join()
    assert back == payload
    assert bytes(echo.received) == payload


def test_each_way_is_delayed(proxied: int) -> None:
    with _connect(proxied) as sock:
        for _ in range(3):
            started = time.perf_counter()
            sock.sendall(b"ping")
            assert _read(sock, 4) == b"ping"
            # There and back: at least the delay each way (a lower bound, whatever the load).
            assert time.perf_counter() - started >= 2 * DELAY


def test_a_target_that_refuses_closes_the_client(native: bool) -> None:
    closed_port = _free_port()  # nothing listens there
    for port in _proxy(closed_port, DELAY, native):
        with _connect(port) as sock:
            sock.sendall(b"hello")
            assert _read(sock, 1) == b""


def test_the_target_hanging_up_reaches_the_client(native: bool) -> None:
    upstream = Upstream(hang_up=True)
    for port in _proxy(upstream.port, DELAY, native):
        with _connect(port) as sock:
            sock.sendall(b"one request")
            assert _read(sock, 1) == b""  # EOF passed on, not a hung connection
        assert bytes(upstream.received) == b"one request"


def test_many_connections_at_once_each_get_their_own_bytes(proxied: int) -> None:
    """As the hosts use it: dozens of pooled connections, each a request and its answer."""
    errors: list[str] = []

    def client(index: int) -> None:
        with _connect(proxied) as sock:
            for turn in range(5):
                message = f"client {index} turn {turn}".encode()
                sock.sendall(message)
                back = _read(sock, len(message))
                if back != message:
                    errors.append(f"{message!r} came back as {back!r}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_the_proxy_cpu_bench_runs() -> None:
    """bench/delay_proxy_cpu.py (docs/benchmarks.md) cannot rot: a tiny run prints its rows."""
    if native_binary() is None:
        pytest.skip("no C compiler: nothing to compare")
    done = subprocess.run(
        [sys.executable, "-m", "bench.delay_proxy_cpu", "--clients", "2", "--round-trips", "5",
         "--repeats", "1", "--delay-ms", "1"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    rows = [line.split()[0] for line in done.stdout.splitlines() if line.endswith((" us", " x"))]
    assert rows == ["C", "Python", "C"], done.stdout  # C, Python, then the ratio C / Python
