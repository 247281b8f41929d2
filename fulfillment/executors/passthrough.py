"""The paid request itself as a purchase's input (an `http` upstream in `request` mode): an
existing API sold as it is, path prefix by path prefix (docs/upstreams.md).

A paid `/x402/<offering>/<rest>` becomes the input {method, path, query, content_type, body,
body_sha256}: what the duplicate window, the quote and the timeline see, and what the http
executor sends to the upstream URL's path + `<rest>`, unchanged. The body travels base64 in
the input, so the offering's `max_input_bytes` bounds it.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from requests.utils import requote_uri

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
# A first segment such as "http:" or "javascript:": an absolute URL, not a path.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
# Decoded by the server, these would have been a slash, a backslash or a dot: a path that
# looks inside the prefix to us and outside it to the upstream.
_ENCODED = re.compile(r"%(2f|5c|2e|25)", re.IGNORECASE)
# What a path segment keeps unquoted (RFC 3986 pchar without "%", which is refused).
_PCHAR = "!$&'()*+,;=:@-._~"


@dataclass(frozen=True)
class PassedRequest:
    method: str
    path: str  # "/<rest>", below the upstream URL's own path
    query: str
    content_type: str
    body: bytes


def passed_path_error(rest: str, raw_path: str | None = None) -> str | None:
    """Why `<rest>` (as the server decoded it) may not be passed through, or None.
    `raw_path`: the request target as sent, when the server gives it (gunicorn, uvicorn)."""
    if not rest:
        return None
    if raw_path is not None and _ENCODED.search(raw_path):
        return "The path may not carry an encoded '/', '\\', '.' or '%'."
    if any(ord(c) < 0x20 or c in "\\%?#\x7f" for c in rest):
        return "The path may not carry a backslash, '%', '?', '#' or a control character."
    segments = rest.split("/")
    if any(segment in ("", ".", "..") for segment in segments[:-1]) or segments[-1] in (
        ".",
        "..",
    ):
        return "The path may not hold an empty, '.' or '..' segment."
    if _SCHEME.match(segments[0]):
        return "An absolute URL cannot be passed through: send a path below the offering."
    return None


def request_input(request: PassedRequest) -> dict[str, Any]:
    """The purchase's input for a passed-through request."""
    return {
        "method": request.method,
        "path": request.path,
        "query": request.query,
        "content_type": request.content_type if request.body else "",
        "body": base64.b64encode(request.body).decode(),
        "body_sha256": hashlib.sha256(request.body).hexdigest(),
    }


def request_from_input(data: dict[str, Any]) -> PassedRequest:
    """Back from the stored input (the executor's side). Raises ValueError if it is not one
    request_input made (an offering switched to `request` mode under older quotes)."""
    method = str(data.get("method", ""))
    path = str(data.get("path", ""))
    if method not in METHODS or not path.startswith("/"):
        raise ValueError("the input is not a passed-through request")
    if passed_path_error(path[1:]) is not None:
        raise ValueError("the stored path escapes the prefix")
    return PassedRequest(
        method=method,
        path=path,
        query=str(data.get("query", "")),
        content_type=str(data.get("content_type", "")),
        body=base64.b64decode(str(data.get("body", "")), validate=True),
    )


def upstream_target(base_path: str, base_query: str, request: PassedRequest) -> str:
    """The signed path: the upstream URL's path + the passed path, with the request's query
    (after the URL's own), quoted as `requests` will send it, so the signature matches."""
    path = base_path.rstrip("/") + quote(request.path, safe="/" + _PCHAR)
    query = "&".join(q for q in (base_query, request.query) if q)
    return str(requote_uri(f"{path}?{query}" if query else path))
