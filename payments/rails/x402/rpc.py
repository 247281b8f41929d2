"""Plain JSON-RPC over HTTP for the paid call's hot path: single calls and batches.

web3.py spends more CPU per call on formatters, middlewares and argument binding than the
call itself costs us, and `requests` about twice the CPU per call of the urllib3 pool
underneath it (docs/benchmarks.md); the settlement's few fixed calls need neither, so they
go straight to a urllib3 pool. Faults keep the types callers classify: a refused or dropped
connection, a timeout or an HTTP error status raise `RpcTransportError` (an OSError, as
requests' own were), a body that is not the JSON-RPC reply to what was sent raises
`RpcReplyInvalid`, and a node's JSON-RPC error object raises `RpcError` with its code and
message. `TRANSPORT_FAULTS` names the first two kinds.

Kept after a re-measure (house step 3, issue 32, 2026-12-07, `make bench BENCH_ARGS="--only
bench.rpc_hot_path"`, 150 settlements a side, side by side): a direct settlement's chain CPU
is 4.67 ms here against 26.61 ms through web3 (5.20x, 4.38 to 7.51), and 5.5 HTTP requests
against 9.5. web3 in its place would add about 22 ms to a paid request's 24.7 ms of CPU
(docs/benchmarks.md): far past the 5% a fast path must save to stay.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import certifi
import urllib3
from requests.utils import (
    get_auth_from_url,
    get_environ_proxies,
    prepend_scheme_if_needed,
    select_proxy,
)
from urllib3 import BaseHTTPResponse
from urllib3.exceptions import HTTPError, NewConnectionError
from urllib3.exceptions import TimeoutError as Urllib3Timeout
from urllib3.util import parse_url

logger = logging.getLogger(__name__)
_QUANTITY = re.compile(r"0x[0-9a-fA-F]{1,64}")
_DATA = re.compile(r"0x(?:[0-9a-fA-F]{2})*")
# gzip as requests asked for it: a batch of a thousand receipts from a hosted node is large.
_HEADERS = {
    "Content-Type": "application/json",
    "Accept-Encoding": "gzip, deflate",
    "User-Agent": f"tollbooth-jsonrpc urllib3/{urllib3.__version__}",
}


class RpcError(Exception):
    """The node answered a call with a JSON-RPC error object: it heard us and said no."""

    def __init__(self, method: str, code: int, message: str, data: Any = None) -> None:
        super().__init__(f"{method}: {message} (code {code})")
        self.method = method
        self.code = code
        self.message = message
        self.data = data


class RpcReplyInvalid(Exception):
    """The HTTP answer is not the JSON-RPC reply to what was sent (garbage, a missing or
    foreign id, a result of the wrong shape): as good as no answer."""


class RpcTransportError(OSError):
    """The node was not reached, or its answer was lost. Its messages name the host and
    port, never the URL's path (where hosted nodes keep the API key)."""


class RpcConnectionError(RpcTransportError):
    """Refused, reset, or closed before the answer came (once the request was written, the
    node may have acted on it)."""


class RpcTimeout(RpcTransportError):
    """No connection, or no answer, within the timeout."""


class RpcHttpError(RpcTransportError):
    """The HTTP answer's status is not 2xx (a gateway's 502, a provider's 429)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {_clip(body.decode('utf-8', 'replace'))}")
        self.status = status


# Faults that say nothing about the call itself: the node was not reached, or its answer lost.
TRANSPORT_FAULTS: tuple[type[Exception], ...] = (RpcTransportError, RpcReplyInvalid)


@dataclass(frozen=True, slots=True)
class RpcCall:
    method: str
    params: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class RpcAnswer:
    """One call's answer within a batch: a result, or the node's error for that call only."""

    call: RpcCall
    result: Any = None
    error: RpcError | None = None

    def value(self) -> Any:
        """The result; raises the call's RpcError if the node refused it."""
        if self.error is not None:
            raise self.error
        return self.result


class JsonRpcClient:
    """JSON-RPC over one RpcTransport with `timeout` seconds per request. Safe across
    threads as far as its transport is (ids come from one atomic counter)."""

    def __init__(self, transport: RpcTransport | FailoverTransport, *, timeout: float) -> None:
        self.transport = transport
        self.timeout = timeout
        self._timeout = rpc_timeout(timeout)
        self._ids = itertools.count(1)

    @property
    def url(self) -> str:
        return self.transport.url

    def call(self, method: str, params: Sequence[Any] = ()) -> Any:
        """The result of one call. Raises RpcError, or a TRANSPORT_FAULTS exception."""
        request_id = next(self._ids)
        reply = self._post(_request(request_id, method, params))
        if not isinstance(reply, dict) or reply.get("id") != request_id:
            raise RpcReplyInvalid(f"{method}: not the reply to call {request_id}: {_clip(reply)}")
        return _answer(RpcCall(method, tuple(params)), reply).value()

    def batch(self, calls: Sequence[RpcCall]) -> list[RpcAnswer]:
        """Every call in one HTTP request; the answers in the order of `calls`, matched by
        id (a node may answer a batch in any order). A refused call is an answer with an
        error; a refused batch raises RpcError, a fault a TRANSPORT_FAULTS exception."""
        if not calls:
            return []
        ids = [next(self._ids) for _ in calls]
        reply = self._post(
            [_request(i, call.method, call.params) for i, call in zip(ids, calls, strict=True)]
        )
        if isinstance(reply, dict) and isinstance(reply.get("error"), dict):
            raise _error("batch", reply["error"])  # the node would not take a batch at all
        if not isinstance(reply, list):
            raise RpcReplyInvalid(f"batch: not a list of replies: {_clip(reply)}")
        by_id = {
            entry["id"]: entry
            for entry in reply
            if isinstance(entry, dict) and isinstance(entry.get("id"), int)
        }
        if len(reply) != len(calls) or set(by_id) != set(ids):
            raise RpcReplyInvalid(f"batch of {len(calls)} answered by {_clip(reply)}")
        return [_answer(call, by_id[i]) for i, call in zip(ids, calls, strict=True)]

    def _post(self, body: object) -> Any:
        return self.transport.post(json.dumps(body).encode(), timeout=self._timeout)


def _request(request_id: int, method: str, params: Sequence[Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": list(params)}


def _answer(call: RpcCall, entry: dict[str, Any]) -> RpcAnswer:
    if entry.get("error") is not None:
        error = entry["error"]
        if not isinstance(error, dict):
            raise RpcReplyInvalid(f"{call.method}: malformed error {_clip(error)}")
        return RpcAnswer(call, error=_error(call.method, error))
    if "result" not in entry:
        raise RpcReplyInvalid(f"{call.method}: reply without a result: {_clip(entry)}")
    return RpcAnswer(call, result=entry["result"])


def _error(method: str, error: dict[str, Any]) -> RpcError:
    code = error.get("code")
    return RpcError(
        method,
        code if isinstance(code, int) and not isinstance(code, bool) else 0,
        str(error.get("message", "")),
        error.get("data"),
    )


def _clip(value: object) -> str:
    return str(value)[:200]


def quantity(value: object) -> int:
    """A JSON-RPC quantity ("0x1a") as an int; RpcReplyInvalid for anything else."""
    if not isinstance(value, str) or not _QUANTITY.fullmatch(value):
        raise RpcReplyInvalid(f"not a quantity: {_clip(value)}")
    return int(value, 16)


def data_bytes(value: object) -> bytes:
    """JSON-RPC data ("0x" + even hex) as bytes; RpcReplyInvalid for anything else."""
    if not isinstance(value, str) or not _DATA.fullmatch(value):
        raise RpcReplyInvalid(f"not hex data: {_clip(value)}")
    return bytes.fromhex(value[2:])


# --- the transport: one urllib3 pool per URL ---------------------------------------------------


class RpcTransport:
    """POSTs of JSON to one RPC URL over one urllib3 connection pool; safe to share between
    `connections` threads at once (rpc_client_for keeps one per thread).

    The environment is read once, here, as requests read it: the proxy for this URL
    (HTTP(S)_PROXY and ALL_PROXY, NO_PROXY honoured, a user:password in the proxy URL sent
    as Proxy-Authorization), and the CA bundle named by REQUESTS_CA_BUNDLE or
    CURL_CA_BUNDLE, else certifi's.

    Nothing is sent twice here: retries and redirects are off, since a settlement's
    broadcast must never be re-sent behind the caller's back (the caller owns retrying,
    within its deadline). A kept-alive connection the node closed while idle is noticed
    when it leaves the pool (urllib3 checks it for EOF) and replaced before anything is
    written. One that closes while the request is in flight raises RpcConnectionError: the
    node may or may not have acted on it. For eth_sendRawTransaction that is harmless, as
    the caller's next attempt sends the same signed bytes, which the node answers "already
    known" (or "nonce too low" once mined) and which can only ever land once; reads are
    idempotent.

    `requests_sent` counts every POST, a refused one included (the batch reader reports it).
    """

    def __init__(self, url: str, *, connections: int = 1) -> None:
        self.url = url
        self.proxy = _environ_proxy(url)
        self.ca_bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
        self.requests_sent = 0
        self._count_lock = threading.Lock()
        self._pools = _pool_manager(self.proxy, self.ca_bundle or certifi.where(), connections)
        self._urlopen: Callable[..., BaseHTTPResponse] = self._pools.urlopen
        self._target = url
        if self.proxy is None:
            # The node's pool, asked directly: the manager would parse the URL and look the
            # pool up again on every call (about a tenth of the call's CPU).
            self._urlopen = self._pools.connection_from_url(url).urlopen
            self._target = parse_url(url).request_uri

    def post(self, body: bytes, *, timeout: urllib3.Timeout) -> Any:
        """The parsed JSON answer. Raises RpcTransportError, or RpcReplyInvalid for a body
        that is not JSON."""
        with self._count_lock:
            self.requests_sent += 1
        try:
            response = self._urlopen(
                "POST", self._target, body=body, headers=_HEADERS, timeout=timeout,
                retries=False, redirect=False,
            )  # fmt: skip
        except NewConnectionError as exc:  # urllib3 files it under timeouts too
            raise RpcConnectionError(str(exc)) from exc
        except Urllib3Timeout as exc:
            raise RpcTimeout(str(exc)) from exc
        except (HTTPError, OSError) as exc:
            raise RpcConnectionError(str(exc)) from exc
        if not 200 <= response.status < 300:
            raise RpcHttpError(response.status, response.data)
        try:
            return json.loads(response.data)
        except ValueError as exc:  # not JSON, or not text at all
            raise RpcReplyInvalid(f"not JSON: {_clip(response.data)}") from exc

    def close(self) -> None:
        self._pools.clear()


def rpc_timeout(seconds: float) -> urllib3.Timeout:
    """`seconds` to connect and `seconds` for each read, as requests applied one number."""
    return urllib3.Timeout(connect=seconds, read=seconds)


def _environ_proxy(url: str) -> str | None:
    proxy = select_proxy(url, get_environ_proxies(url))
    return prepend_scheme_if_needed(proxy, "http") if proxy else None


def _pool_manager(proxy: str | None, ca: str, connections: int) -> urllib3.PoolManager:
    tls: dict[str, Any] = {"cert_reqs": "CERT_REQUIRED"}
    tls["ca_cert_dir" if os.path.isdir(ca) else "ca_certs"] = ca
    if proxy is None:
        return urllib3.PoolManager(num_pools=1, maxsize=connections, **tls)
    if proxy.lower().startswith("socks"):
        from urllib3.contrib.socks import SOCKSProxyManager  # needs PySocks, as in requests

        user, password = get_auth_from_url(proxy)
        return SOCKSProxyManager(proxy, username=user or None, password=password or None,
                                 num_pools=1, maxsize=connections, **tls)  # fmt: skip
    user, password = get_auth_from_url(proxy)
    headers = urllib3.make_headers(proxy_basic_auth=f"{user}:{password}") if user else None
    return urllib3.ProxyManager(
        proxy, proxy_headers=headers, num_pools=1, maxsize=connections, **tls
    )


# --- a second URL: failover on the node's faults ---------------------------------------------


# After the first URL failed, the second is asked first for this long, so a node that is down
# does not cost every call its timeout; then the first is tried again.
FAILOVER_COOLDOWN_SECONDS = 30.0


def fails_over(exc: RpcTransportError) -> bool:
    """The faults that send a request to the second URL: the node was not reached or did not
    answer in time (connection refused, reset, timed out) or answered 5xx. A JSON-RPC error,
    a 4xx (a rate limit, a bad key) or a garbled body do not: that node heard us."""
    if isinstance(exc, RpcHttpError):
        return exc.status >= 500
    return isinstance(exc, RpcConnectionError | RpcTimeout)


class FailoverTransport:
    """Two RpcTransports for one network (X402_<NET>_RPC_URL and X402_<NET>_RPC_URL_FALLBACK):
    a request goes to the preferred one, and on a fault that `fails_over` to the other, once.

    Safe for every call this client makes: reads are idempotent, and a broadcast sent to the
    second node after the first failed is the same signed bytes, which can land only once
    (the second node answers "already known" or "nonce too low" if it has them; the callers
    treat both as sent). At worst a request costs two timeouts. Which one is preferred is
    per transport (per thread), for FAILOVER_COOLDOWN_SECONDS after the first URL failed.
    """

    def __init__(
        self, primary: RpcTransport, secondary: RpcTransport, *, clock: Callable[[], float]
    ) -> None:
        self.primary = primary
        self.secondary = secondary
        self.url = primary.url
        self._clock = clock
        self._primary_down_until = 0.0

    @property
    def requests_sent(self) -> int:
        return self.primary.requests_sent + self.secondary.requests_sent

    def post(self, body: bytes, *, timeout: urllib3.Timeout) -> Any:
        """As RpcTransport.post, over the preferred URL, then the other on a failover fault."""
        first, second = self._order()
        try:
            return first.post(body, timeout=timeout)
        except RpcTransportError as exc:
            if not fails_over(exc):
                raise
            self._primary_down_until = (
                self._clock() + FAILOVER_COOLDOWN_SECONDS if first is self.primary else 0.0
            )
            logger.warning("RPC %s failed (%s): asking %s", _host(first.url), type(exc).__name__,
                           _host(second.url))  # fmt: skip
        return second.post(body, timeout=timeout)

    def _order(self) -> tuple[RpcTransport, RpcTransport]:
        if self._clock() < self._primary_down_until:
            return self.secondary, self.primary
        return self.primary, self.secondary

    def close(self) -> None:
        self.primary.close()
        self.secondary.close()


def _host(url: str) -> str:
    # Host and port only: a hosted node's URL keeps its API key in the path.
    parsed = parse_url(url)
    return f"{parsed.host}:{parsed.port}" if parsed.port else str(parsed.host)


def transport_for(
    rpc_url: str, fallback: str = "", *, connections: int = 1
) -> RpcTransport | FailoverTransport:
    """A new transport for a network's URL, failing over to `fallback` when one is set."""
    primary = RpcTransport(rpc_url, connections=connections)
    if not fallback:
        return primary
    secondary = RpcTransport(fallback, connections=connections)
    return FailoverTransport(primary, secondary, clock=time.monotonic)


# --- one transport and one client per URL per thread ------------------------------------------


_per_thread = threading.local()


def thread_transport(rpc_url: str, fallback: str = "") -> RpcTransport | FailoverTransport:
    """This thread's transport for `rpc_url` (failing over to `fallback` when set), shared by
    its JSON-RPC clients and its web3 clients (payments.rails.x402.chain.w3_for), so they
    reuse one kept-alive connection."""
    transports: dict[tuple[str, str], RpcTransport | FailoverTransport] = (
        _per_thread.__dict__.setdefault("transports", {})
    )
    transport = transports.get((rpc_url, fallback))
    if transport is None:
        transport = transports[(rpc_url, fallback)] = transport_for(rpc_url, fallback)
    return transport


def rpc_client_for(rpc_url: str, *, timeout: float, fallback: str = "") -> JsonRpcClient:
    """This thread's JSON-RPC client for `rpc_url` (failing over to `fallback` when set)
    with `timeout` seconds per request."""
    clients: dict[tuple[str, str, float], JsonRpcClient] = _per_thread.__dict__.setdefault(
        "clients", {}
    )
    client = clients.get((rpc_url, fallback, timeout))
    if client is None:
        client = clients[(rpc_url, fallback, timeout)] = JsonRpcClient(
            thread_transport(rpc_url, fallback), timeout=timeout
        )
    return client


__all__ = [
    "TRANSPORT_FAULTS",
    "FailoverTransport",
    "JsonRpcClient",
    "RpcAnswer",
    "RpcCall",
    "RpcConnectionError",
    "RpcError",
    "RpcHttpError",
    "RpcReplyInvalid",
    "RpcTimeout",
    "RpcTransport",
    "RpcTransportError",
    "data_bytes",
    "quantity",
    "rpc_client_for",
    "rpc_timeout",
    "thread_transport",
    "transport_for",
]
