"""The `http` executor: one synchronous, signed call to the seller's own endpoint.

Every call carries `Idempotency-Key` (one per purchase, the same on every retry and every
later check), `Tollbooth-Purchase` and a signature (docs/upstreams.md), so the upstream can
refuse strangers and answer a repeat with its first answer instead of acting twice.

What an answer becomes: 2xx within the size cap is the result (its content type kept); a
4xx the offering declared definitive is a failure (the work did not happen); an answer over
the cap is unknown and escalates at once (the effect happened, another call cannot fix the
size); anything else (timeout, reset, 5xx, 429, another 4xx) is unknown and retried with the
same key. There is no call without the key: the JobSpec always has one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from urllib.parse import urlencode, urlsplit

import requests

from fulfillment.executors.base import (
    ExecutorError,
    JobOutput,
    JobSpec,
    JobStatus,
    SigningKey,
    Started,
    UpstreamSpec,
)
from fulfillment.executors.passthrough import request_from_input, upstream_target

SIGNATURE_VERSION = "v1"
_REF_PREFIX = "http_"


def string_to_sign(timestamp: str, method: str, path: str, body: bytes) -> bytes:
    """Timestamp, method, path (with its query) and the body's SHA-256, one per line."""
    digest = hashlib.sha256(body).hexdigest()
    return f"{timestamp}\n{method.upper()}\n{path}\n{digest}".encode()


def signature(secret: bytes, timestamp: str, method: str, path: str, body: bytes) -> str:
    mac = hmac.new(secret, string_to_sign(timestamp, method, path, body), hashlib.sha256)
    return f"{SIGNATURE_VERSION}={mac.hexdigest()}"


def signature_header(
    keys: list[SigningKey], timestamp: str, method: str, path: str, body: bytes
) -> str:
    """One `v1=<hex>` per key, comma separated, each after `kid=<id>;` when the key has an
    id. A single secret without a key id gives the header of before: `v1=<hex>` alone."""
    return ", ".join(
        (f"kid={key.key_id};" if key.key_id else "")
        + signature(key.secret, timestamp, method, path, body)
        for key in keys
    )


def signed_headers(
    upstream: UpstreamSpec, method: str, path: str, body: bytes, *, now: float | None = None
) -> dict[str, str]:
    """The timestamp and signature headers for one request (the secrets read now). During a
    rotation the call is signed with both secrets, so the upstream may hold either."""
    keys = upstream.signing_keys()
    for key in keys:
        if not key.secret:
            # Nothing was sent, but the seller can fix the variable: retry, then escalate.
            raise ExecutorError(
                "upstream_secret_missing",
                f"environment variable {key.env or '(unnamed)'} is not set",
            )
    timestamp = str(int(now if now is not None else time.time()))
    return {
        "Tollbooth-Timestamp": timestamp,
        "Tollbooth-Signature": signature_header(keys, timestamp, method, path, body),
    }


class HttpExecutor:
    name = "http"
    # Resuming calls `start` again with the same key: the upstream answers the repeat.
    finishes_in_start = True

    def __init__(self, upstream: UpstreamSpec, session: requests.Session | None = None) -> None:
        self.upstream = upstream
        self.session = session or requests.Session()

    def start(self, job: JobSpec) -> Started:
        up = self.upstream
        if not job.idempotency_key.strip():
            # Never a call without the key: without it the upstream cannot drop a repeat.
            raise ExecutorError("upstream_unavailable", "no idempotency key: no call made")
        method, url, path, body, content_type = _request_parts(up, job)
        headers = {
            "Idempotency-Key": job.idempotency_key,
            "Tollbooth-Purchase": job.purchase_ref,
            **signed_headers(up, method, path, body),
        }
        if body:
            headers["Content-Type"] = content_type
        try:
            with self.session.request(
                method, url, data=body or None, headers=headers, timeout=up.timeout, stream=True
            ) as response:
                return _answer(up, job, response)
        except requests.RequestException as exc:
            raise ExecutorError("upstream_unreachable", f"{method} {url}: {exc}") from exc

    def poll(self, job_ref: str) -> JobStatus:
        # Our refs exist only once the upstream answered 2xx; nothing else is ours to judge.
        return JobStatus.SUCCEEDED if job_ref.startswith(_REF_PREFIX) else JobStatus.UNKNOWN

    def fetch(self, job_ref: str) -> JobOutput:
        # The answer is kept only by calling again with the same key (start): never "failed".
        raise ExecutorError("result_unavailable", "call start() again with the same key")


def _request_parts(up: UpstreamSpec, job: JobSpec) -> tuple[str, str, str, bytes, str]:
    """Method, full URL, the signed path (with query), the body and its content type."""
    parts = urlsplit(up.url)
    path, query = parts.path or "/", parts.query
    if up.input_mode == "request":
        try:
            passed = request_from_input(job.input)
        except ValueError as exc:
            # Nothing was sent: the stored input cannot become a request.
            raise ExecutorError("upstream_rejected", str(exc), definitive=True) from exc
        target = upstream_target(parts.path, query, passed)
        url = f"{parts.scheme}://{parts.netloc}{target}"
        content_type = passed.content_type or "application/octet-stream"
        return passed.method, url, target, passed.body, content_type
    body = b""
    if up.input_mode == "query":
        extra = urlencode(
            sorted((k, v if isinstance(v, str) else json.dumps(v)) for k, v in job.input.items())
        )
        query = f"{query}&{extra}" if query and extra else (query or extra)
    else:
        body = json.dumps(job.input, sort_keys=True, separators=(",", ":")).encode()
    signed_path = f"{path}?{query}" if query else path
    url = f"{parts.scheme}://{parts.netloc}{signed_path}"
    return up.method, url, signed_path, body, "application/json"


def _answer(up: UpstreamSpec, job: JobSpec, response: requests.Response) -> Started:
    status = response.status_code
    if 200 <= status < 300:
        content = response.raw.read(up.max_result_bytes + 1, decode_content=True)
        if len(content) > up.max_result_bytes:
            raise ExecutorError(
                "upstream_result_too_large",
                f"answer over {up.max_result_bytes} bytes: the work ran, the result is not kept",
                retryable=False,
            )
        content_type = response.headers.get("Content-Type") or "application/octet-stream"
        ref = _REF_PREFIX + hashlib.sha256(job.idempotency_key.encode()).hexdigest()[:32]
        return Started(job_ref=ref, output=JobOutput(content=content, content_type=content_type))
    detail = f"HTTP {status}: {response.raw.read(300, decode_content=True)!r}"
    if status in up.definitive_statuses:
        raise ExecutorError("upstream_rejected", detail, definitive=True)
    raise ExecutorError("upstream_unavailable", detail)
