"""The delay proxies' own CPU per round trip, C against Python, side by side in one run.

    .venv/bin/python -m bench.delay_proxy_cpu [--clients 32] [--round-trips 400] [--repeats 5]

In `make bench-hosts` the proxies stand in for the network but share the machine's 2 cores
with the hosts they connect: what they spend is taken from the across-hosts side. Each
repeat starts one proxy of each kind in front of an echo server, drives the same load
through each (`--clients` connections, each `--round-trips` small request/answer pairs,
as a pooled database connection is used) and reads the proxy process's CPU time from
/proc. Prints microseconds of proxy CPU per round trip and the ratio, min/median/max.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.delay_proxy import command  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def _echo_server() -> int:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(256)

    def echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def serve() -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return int(server.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def _drive(port: int, clients: int, round_trips: int) -> None:
    def client() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(round_trips):
                sock.sendall(b"x" * 120)  # about a short statement and its answer
                got = 0
                while got < 120:
                    got += len(sock.recv(65536))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def measure(native: bool, target: int, clients: int, round_trips: int, delay_ms: float) -> float:
    """Microseconds of the proxy's CPU per round trip."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    link = f"127.0.0.1:{port}=127.0.0.1:{target}"
    process = subprocess.Popen(
        command(delay_ms, [link], native=native), cwd=ROOT, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        assert process.stdout is not None and "ready" in process.stdout.readline()
        before = _cpu_seconds(process.pid)
        _drive(port, clients, round_trips)
        spent = _cpu_seconds(process.pid) - before
    finally:
        process.terminate()
        process.wait(timeout=10)
    return spent / (clients * round_trips) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--round-trips", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--delay-ms", type=float, default=2.0)
    args = parser.parse_args(argv)
    target = _echo_server()
    c_side, python_side, ratios = [], [], []
    for repeat in range(args.repeats):
        order = (True, False) if repeat % 2 == 0 else (False, True)  # alternated
        spent = {
            n: measure(n, target, args.clients, args.round_trips, args.delay_ms) for n in order
        }
        c_side.append(spent[True])
        python_side.append(spent[False])
        ratios.append(spent[True] / spent[False] if spent[False] else 0.0)

    def line(name: str, values: list[float], unit: str) -> str:
        return (f"{name:<44} {min(values):8.2f} {statistics.median(values):8.2f} "
                f"{max(values):8.2f} {unit}")  # fmt: skip

    load = os.getloadavg()[0]
    print(f"{'delay proxy CPU per round trip':<44} {'min':>8} {'median':>8} {'max':>8}")
    print(line("C (bench/delay_proxy.c)", c_side, "us"))
    print(line("Python (bench/delay_proxy.py)", python_side, "us"))
    print(line("C / Python", ratios, "x"))
    print(f"\n{args.clients} clients x {args.round_trips} round trips per side per repeat, "
          f"{args.repeats} repeats, {args.delay_ms:g} ms each way, "
          f"load average {load:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
