"""A real HTTP receiver for webhooks, in a thread: it records what it got and answers as told."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float = 0.0  # time.monotonic() when it arrived


@dataclass
class Receiver:
    url: str
    received: list[Received] = field(default_factory=list)
    status: int = 200
    answer: bytes = b"ok"
    delay_seconds: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)  # sent with every answer


def _handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            receiver.received.append(
                Received(self.path, dict(self.headers.items()), body, time.monotonic())
            )
            if receiver.delay_seconds:
                time.sleep(receiver.delay_seconds)  # the slow endpoint under test
            try:
                self.send_response(receiver.status)
                self.send_header("Content-Length", str(len(receiver.answer)))
                for name, value in receiver.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(receiver.answer)
            except OSError:
                pass  # the client gave up (its timeout): what a slow endpoint sees

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with serving() as state:
        yield state


@contextmanager
def serving() -> Iterator[Receiver]:
    """Another receiver, for a test that needs more than one."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(Receiver(url="")))
    state = Receiver(url=f"http://127.0.0.1:{server.server_address[1]}/hooks")
    server.RequestHandlerClass = _handler(state)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def dead_url() -> str:
    """A local port nobody listens on: every connection is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/hooks"
