"""Checking an upstream without buying anything: is it reachable, how fast, does it accept
our signature. The operation itself is never called; a signed call is made only to the
dry-run target the upstream's configuration declares."""

from __future__ import annotations

import socket
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import requests

from fulfillment.executors.base import ExecutorError, UpstreamSpec, registered_names
from fulfillment.executors.http import signed_headers
from fulfillment.executors.mcp import tool_names


@dataclass
class UpstreamCheck:
    ok: bool = True
    lines: list[tuple[str, str]] = field(default_factory=list)  # (what, finding)

    def note(self, what: str, finding: str, *, bad: bool = False) -> None:
        self.lines.append((what, finding))
        self.ok = self.ok and not bad


def upstream_check(spec: UpstreamSpec) -> UpstreamCheck:
    """What is wrong with the upstream, if anything. Never a paid effect: reachability is a
    TCP connect; a request is sent only to `spec.dry_run`, when declared."""
    check = UpstreamCheck()
    if spec.kind == "python":
        found = spec.entry_point in registered_names()
        check.note(
            "executor",
            f"entry point {spec.entry_point!r} "
            + ("installed" if found else "NOT installed in this environment"),
            bad=not found,
        )
        return check
    if spec.kind != "mcp":
        _check_secret(spec, check)
    _check_reachable(spec, check)
    if spec.kind == "mcp" and check.ok:
        _check_tool(spec, check)
        return check
    if spec.dry_run and check.ok:
        _check_dry_run(spec, check)
    elif not spec.dry_run:
        check.note("dry run", "none declared: the operation is never called by a check")
    return check


def _check_tool(spec: UpstreamSpec, check: UpstreamCheck) -> None:
    """initialize + tools/list only: listing calls no tool, so nothing is paid for."""
    started = time.monotonic()
    try:
        names = tool_names(spec)
    except Exception as exc:
        check.note("mcp", f"initialize/tools/list failed: {exc!r}", bad=True)
        return
    latency = (time.monotonic() - started) * 1000
    found = spec.tool in names
    check.note(
        "mcp",
        f"tools/list answered in {latency:.0f} ms; tool {spec.tool!r} "
        + ("is listed" if found else f"is NOT listed (has: {', '.join(names) or 'none'})"),
        bad=not found,
    )


def _check_secret(spec: UpstreamSpec, check: UpstreamCheck) -> None:
    if not spec.secret_env:
        check.note("secret", "none named (calls are unsigned)", bad=spec.kind == "http")
        return
    for key in spec.signing_keys():
        role = "previous (rotation under way)" if key.env == spec.previous_secret_env else ""
        kid = f" (key id {key.key_id})" if key.key_id else ""
        found = "is set" if key.secret else "is NOT set in this environment"
        check.note(f"{role} secret".strip(), f"{key.env}{kid} {found}", bad=not key.secret)


def _check_reachable(spec: UpstreamSpec, check: UpstreamCheck) -> None:
    parts = urlsplit(spec.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    started = time.monotonic()
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=spec.timeout):
            pass
    except OSError as exc:
        check.note("reachable", f"{parts.hostname}:{port} NOT reachable: {exc}", bad=True)
        return
    latency = (time.monotonic() - started) * 1000
    check.note("reachable", f"{parts.hostname}:{port} accepts connections ({latency:.0f} ms)")


def _check_dry_run(spec: UpstreamSpec, check: UpstreamCheck) -> None:
    parts = urlsplit(spec.url)
    method = str(spec.dry_run.get("method", "GET")).upper()
    path = str(spec.dry_run["path"])
    body = str(spec.dry_run.get("body", "")).encode()
    headers = {"Idempotency-Key": f"tollbooth-check-{uuid.uuid4().hex}", "Tollbooth-Check": "1"}
    started = time.monotonic()
    try:
        if spec.secret_env:
            headers.update(signed_headers(spec, method, path, body))
        response = requests.request(
            method,
            f"{parts.scheme}://{parts.netloc}{path}",
            data=body or None,
            headers=headers,
            timeout=spec.timeout,
        )
    except (requests.RequestException, ExecutorError) as exc:
        check.note("dry run", f"{method} {path} failed: {exc}", bad=True)
        return
    latency = (time.monotonic() - started) * 1000
    status = response.status_code
    if status in (401, 403):
        check.note("auth", f"{method} {path} refused our signature (HTTP {status})", bad=True)
    elif 200 <= status < 300:
        check.note("auth", f"{method} {path} answered {status} in {latency:.0f} ms")
    else:
        check.note("dry run", f"{method} {path} answered HTTP {status}", bad=True)
