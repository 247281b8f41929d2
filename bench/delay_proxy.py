"""A TCP proxy that adds a fixed delay each way: the latency between hosts in
`make bench-hosts` (bench/hosts.py), where the kernel has no netem.

    python -m bench.delay_proxy --delay-ms 2 127.0.0.1:5432=10.231.0.30:5432 [more links]

Every chunk read from one side is written to the other `delay` later, in order; reading
never waits for the delay, so the link adds latency, not a bandwidth cap. When one side
closes or fails, both are closed: a cut link looks to each end as it would on a network.
Prints "delay proxy ready" once every link listens.

`command()` is how the bench starts one: bench/delay_proxy.c, the same proxy in C, built
once with the system's C compiler (the proxies share the machine's cores with the hosts
they connect, and a network costs its hosts no CPU); this module where there is none.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

CHUNK = 65536
SOURCE_C = Path(__file__).with_name("delay_proxy.c")
BUILD_DIR = Path(__file__).resolve().parents[1] / "var" / "bench"


def native_binary() -> Path | None:
    """bench/delay_proxy.c built (once per source: the name carries its hash), or None
    where there is no C compiler."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None
    digest = hashlib.sha256(SOURCE_C.read_bytes()).hexdigest()[:12]
    binary = BUILD_DIR / f"delay_proxy-{digest}"
    if not binary.exists():
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        partial = binary.with_suffix(f".{os.getpid()}")  # concurrent builds do not collide
        subprocess.run([compiler, "-O2", "-Wall", "-o", str(partial), str(SOURCE_C)], check=True)
        partial.replace(binary)
    return binary


def command(delay_ms: float, links: list[str], native: bool = True) -> list[str]:
    """The command line of a proxy for these links: the C build unless told otherwise or
    there is no compiler, else this module."""
    binary = native_binary() if native else None
    if binary is not None:
        return [str(binary), "--delay-ms", str(delay_ms), *links]
    return [sys.executable, "-m", "bench.delay_proxy", "--delay-ms", str(delay_ms), *links]


def split_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy reader to writer, each chunk written `delay` after it was read."""
    queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()

    async def read() -> None:
        while True:
            try:
                data = await reader.read(CHUNK)
            except OSError:
                queue.put_nowait((0.0, None))  # a reset: passed on at once, not delayed
                return
            queue.put_nowait((time.monotonic() + delay, data))
            if not data:
                return

    async def write() -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if data is None:
                raise ConnectionResetError("the other side failed")
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    reading = asyncio.ensure_future(read())
    try:
        await write()
    finally:
        reading.cancel()


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError, asyncio.CancelledError):
        await writer.wait_closed()


def _handler(target: tuple[str, int], delay: float) -> Handler:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*target)
        except OSError:
            await _close(client_w)
            return
        for writer in (client_w, server_w):  # small chunks must not wait for Nagle
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pumps = [
            asyncio.ensure_future(_pump(client_r, server_w, delay)),
            asyncio.ensure_future(_pump(server_r, client_w, delay)),
        ]
        try:
            # A half-close is passed on (EOF); the link ends when both directions have, or
            # at the first failure of either side.
            pending = set(pumps)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                if any(task.exception() for task in done if not task.cancelled()):
                    break
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for task in pumps:
                task.cancel()
            await _close(client_w)
            await _close(server_w)

    return handle


async def serve(links: list[tuple[tuple[str, int], tuple[str, int]]], delay: float) -> None:
    servers = []
    for listen, target in links:
        handler = _handler(target, delay)
        servers.append(await asyncio.start_server(handler, *listen, reuse_address=True))
    print("delay proxy ready", flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--delay-ms", type=float, default=2.0, help="added each way")
    parser.add_argument("links", nargs="+", help="LISTEN_HOST:PORT=TARGET_HOST:PORT")
    args = parser.parse_args(argv)
    links = []
    for link in args.links:
        listen, _, target = link.partition("=")
        links.append((split_address(listen), split_address(target)))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(links, args.delay_ms / 1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
