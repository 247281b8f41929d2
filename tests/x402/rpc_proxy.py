"""For the batch reader and JSON-RPC client tests (the `rpc_proxy` fixture is in
conftest.py): a recording (and, on demand, faulty) JSON-RPC proxy in front of a real anvil
node, and cheap authorizations with random nonces.

The proxy forwards every request to the node unchanged, so the chain answering is real; it
records what went over the wire (an independent count of round trips) and lets a test
corrupt a reply, or drop the connection unanswered, as a flaky or capped node would. It
also serves as an HTTP forward proxy (the request line's absolute URL is ignored), over TLS
when given a server context, and, on demand, closes every connection right after answering
on it while having promised to keep it alive, as a node's idle timeout does.
"""

from __future__ import annotations

import http.server
import json
import secrets
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import requests
from hexbytes import HexBytes
from web3 import Web3

from payments.rails.x402.types import Authorization
from tests.x402.chain_env import PRICE, ChainEnv


@dataclass(frozen=True)
class RawReply:
    """A reply a tamper hook sends as is: any status, any body."""

    status: int
    body: bytes


# A tamper hook's answer meaning: close the connection without replying (the node did get
# the request: its answer is what is lost).
DROP_CONNECTION = RawReply(0, b"")

# A hook gets the request body (a call, or a list of them) and the node's reply, and
# returns the reply to send on: a JSON-able value, or a RawReply.
Tamper = Callable[[Any, Any], Any]


class RpcProxy:
    """An HTTP server forwarding JSON-RPC to `upstream`; see the module docstring."""

    def __init__(
        self,
        upstream: str,
        *,
        tls: ssl.SSLContext | None = None,
        close_after_reply: bool = False,
    ) -> None:
        self.upstream = upstream
        self.requests: list[Any] = []  # request bodies, in order
        self.tamper: Tamper | None = None
        self.close_after_reply = close_after_reply
        self.connections_closed = threading.Semaphore(0)  # released as each one is closed
        self._lock = threading.Lock()
        self._server = _ProxyServer(("127.0.0.1", 0), _ProxyHandler)
        self._server.proxy = self
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self._server.server_address[1]}"

    def forward(self, raw: bytes) -> RawReply:
        body = json.loads(raw)
        with self._lock:
            self.requests.append(body)
        reply = requests.post(
            self.upstream, data=raw, headers={"Content-Type": "application/json"}, timeout=120
        ).json()
        if self.tamper is not None:
            reply = self.tamper(body, reply)
        if isinstance(reply, RawReply):
            return reply
        return RawReply(200, json.dumps(reply).encode())

    def methods(self) -> list[str | list[str]]:
        """Each request's method, or the methods of a batch."""
        return [
            [call["method"] for call in body] if isinstance(body, list) else body["method"]
            for body in self.requests
        ]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _ProxyServer(http.server.ThreadingHTTPServer):
    proxy: RpcProxy

    def shutdown_request(self, request: socket.socket | tuple[bytes, socket.socket]) -> None:
        super().shutdown_request(request)
        self.proxy.connections_closed.release()


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: _ProxyServer

    def setup(self) -> None:
        super().setup()
        if self.server.proxy.close_after_reply:
            self.protocol_version = "HTTP/1.1"  # keep-alive is promised, then broken

    def do_POST(self) -> None:
        proxy = self.server.proxy
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        reply = proxy.forward(raw)
        if reply is DROP_CONNECTION:
            self.close_connection = True
            return
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        self.wfile.write(reply.body)
        if proxy.close_after_reply:
            self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


def random_hash() -> str:
    return HexBytes(secrets.token_bytes(32)).to_0x_hex()


def random_authorization(env: ChainEnv, *, valid_before: int) -> Authorization:
    """An authorization nobody signed: a random payer and nonce and a dummy signature.

    Only chain reads happen in these tests, and no read looks at the signature.
    """
    return Authorization(
        payer=Web3.to_checksum_address("0x" + secrets.token_hex(20)),
        to=env.seller.address,
        value=PRICE,
        valid_after=0,
        valid_before=valid_before,
        nonce=random_hash(),
        signature="0x" + "00" * 65,
    )
