"""Plain JSON-RPC over HTTP for the paid call's hot path: single calls and batches.

web3.py spends more CPU per call on formatters, middlewares and argument binding than the
call itself costs us; the settlement's few fixed calls need none of it. Faults keep the
types callers already classify: a refused or dropped connection, a timeout or an HTTP error
status raise `requests.RequestException` (or `OSError`), a body that is not the JSON-RPC
reply to what was sent raises `RpcReplyInvalid`, and a node's JSON-RPC error object raises
`RpcError` with its code and message. `TRANSPORT_FAULTS` names the first two kinds.
"""

from __future__ import annotations

import itertools
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import requests

_QUANTITY = re.compile(r"0x[0-9a-fA-F]{1,64}")
_DATA = re.compile(r"0x(?:[0-9a-fA-F]{2})*")


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


# Faults that say nothing about the call itself: the node was not reached, or its answer lost.
TRANSPORT_FAULTS: tuple[type[Exception], ...] = (
    requests.RequestException,
    OSError,
    RpcReplyInvalid,
)


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
    """JSON-RPC to one URL over one `requests` session. Not shared between threads:
    `rpc_client_for` keeps one per thread."""

    def __init__(self, url: str, *, timeout: float, session: requests.Session) -> None:
        self.url = url
        self.timeout = timeout
        self.session = session
        self._ids = itertools.count(1)

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
        response = self.session.post(self.url, json=body, timeout=self.timeout)
        response.raise_for_status()
        return response.json()  # a body that is not JSON raises a RequestException


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


# --- one session and one client per URL per thread --------------------------------------------


def rpc_session(rpc_url: str) -> requests.Session:
    """An HTTP session for one RPC URL that reads the environment once, when it is made:
    `requests` otherwise looks the proxy variables up again on every call (about a
    millisecond each, some nine calls a paid request). The proxy for this URL (NO_PROXY
    honoured) and a CA bundle named by REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE still apply."""
    session = requests.Session()
    session.trust_env = False
    session.proxies = dict(requests.utils.get_environ_proxies(rpc_url))
    bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
    if bundle:
        session.verify = bundle
    return session


_per_thread = threading.local()


def thread_session(rpc_url: str) -> requests.Session:
    """This thread's session for `rpc_url`, shared by its web3 clients and its JSON-RPC
    clients, so they reuse one kept-alive connection. Sessions are not thread-safe."""
    sessions: dict[str, requests.Session] = _per_thread.__dict__.setdefault("sessions", {})
    session = sessions.get(rpc_url)
    if session is None:
        session = sessions[rpc_url] = rpc_session(rpc_url)
    return session


def rpc_client_for(rpc_url: str, *, timeout: float) -> JsonRpcClient:
    """This thread's JSON-RPC client for `rpc_url` with `timeout` seconds per request."""
    clients: dict[tuple[str, float], JsonRpcClient] = _per_thread.__dict__.setdefault("clients", {})
    client = clients.get((rpc_url, timeout))
    if client is None:
        client = clients[(rpc_url, timeout)] = JsonRpcClient(
            rpc_url, timeout=timeout, session=thread_session(rpc_url)
        )
    return client


__all__ = [
    "TRANSPORT_FAULTS",
    "JsonRpcClient",
    "RpcAnswer",
    "RpcCall",
    "RpcError",
    "RpcReplyInvalid",
    "data_bytes",
    "quantity",
    "rpc_client_for",
    "rpc_session",
    "thread_session",
]
