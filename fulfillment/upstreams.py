"""Per-offering upstreams: validation of their configuration and the frozen value an
executor gets (UpstreamSpec). Kept apart from the model so both the admin form and the
services use one set of rules."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from django.core.exceptions import ValidationError

from fulfillment.executors.base import UpstreamSpec

if TYPE_CHECKING:
    from fulfillment.models import Upstream

# Upper case, digits and underscores, not starting with a digit: what a shell exports.
ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,99}")
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
MIN_TIMEOUT, MAX_TIMEOUT = Decimal("0.1"), Decimal("300")
MAX_RESULT_BYTES = 64 * 1024 * 1024
MAX_TRIES = 100
MAX_DEADLINE_SECONDS = 7 * 24 * 3600  # a week: past it a person decides anyway
NEEDS_URL = frozenset({"http", "http_job", "mcp"})


def upstream_validate(upstream: Upstream) -> None:
    """Raise ValidationError naming every field that is wrong."""
    errors: dict[str, str] = {}
    secret_field = "secret_env"  # noqa: S105  (a field name: the secret is never on the row)
    if upstream.kind in NEEDS_URL:
        parts = urlsplit(upstream.url or "")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            errors["url"] = "An http:// or https:// URL with a host is required for this kind."
    if upstream.kind == "python" and not re.fullmatch(
        r"[A-Za-z0-9_.-]{1,64}", upstream.entry_point
    ):
        errors["entry_point"] = "Name the executor's entry point (group tollbooth.executors)."
    if upstream.kind == "mcp" and not re.fullmatch(r"[A-Za-z0-9_./-]{1,128}", upstream.tool):
        errors["tool"] = "Name the MCP tool that does the work."
    if str(upstream.method).upper() not in METHODS:
        errors["method"] = f"One of {', '.join(sorted(METHODS))}."
    if upstream.secret_env and not ENV_NAME.fullmatch(upstream.secret_env):
        errors[secret_field] = "An environment variable NAME (A-Z, 0-9, _), not the secret."
    if upstream.kind == "http" and not upstream.secret_env:
        errors[secret_field] = "An http upstream signs every call: name its secret's variable."
    if not MIN_TIMEOUT <= Decimal(str(upstream.timeout_seconds)) <= MAX_TIMEOUT:
        errors["timeout_seconds"] = f"Between {MIN_TIMEOUT} and {MAX_TIMEOUT} seconds."
    if not 1 <= int(upstream.max_result_bytes) <= MAX_RESULT_BYTES:
        errors["max_result_bytes"] = f"Between 1 and {MAX_RESULT_BYTES} bytes."
    codes = upstream.definitive_statuses
    if not isinstance(codes, list) or not all(
        isinstance(c, int) and not isinstance(c, bool) and 400 <= c <= 499 for c in codes
    ):
        errors["definitive_statuses"] = "A list of 4xx codes, e.g. [400, 422]."
    elif 429 in codes:
        errors["definitive_statuses"] = "429 means 'not now': it can never be definitive."
    if upstream.max_tries is not None and not 1 <= int(upstream.max_tries) <= MAX_TRIES:
        errors["max_tries"] = f"Between 1 and {MAX_TRIES}, or empty for the default."
    deadline = upstream.deadline_seconds
    if deadline is not None and not 1 <= int(deadline) <= MAX_DEADLINE_SECONDS:
        errors["deadline_seconds"] = f"Between 1 and {MAX_DEADLINE_SECONDS}, or empty."
    dry_run_error = _dry_run_error(upstream.dry_run)
    if dry_run_error:
        errors["dry_run"] = dry_run_error
    if errors:
        raise ValidationError(errors)


def _dry_run_error(dry_run: Any) -> str:
    if dry_run in (None, {}):
        return ""
    if not isinstance(dry_run, dict) or set(dry_run) - {"method", "path", "body"}:
        return 'An object with "method", "path" and optionally "body".'
    if str(dry_run.get("method", "GET")).upper() not in METHODS:
        return f"method: one of {', '.join(sorted(METHODS))}."
    if not str(dry_run.get("path", "")).startswith("/"):
        return 'path: an absolute path on the upstream, e.g. "/health".'
    return ""


def upstream_spec(upstream: Upstream) -> UpstreamSpec:
    """The frozen value an executor gets, read from the row at claim time."""
    return UpstreamSpec(
        kind=upstream.kind,
        url=upstream.url,
        method=str(upstream.method).upper(),
        timeout=float(upstream.timeout_seconds),
        input_mode=upstream.input_mode,
        secret_env=upstream.secret_env,
        definitive_statuses=frozenset(int(c) for c in upstream.definitive_statuses or ()),
        max_result_bytes=int(upstream.max_result_bytes),
        idempotent=bool(upstream.idempotent),
        entry_point=upstream.entry_point,
        tool=upstream.tool,
        dry_run=dict(upstream.dry_run or {}),
        max_tries=upstream.max_tries,
        deadline_seconds=upstream.deadline_seconds,
    )


# What a change to an upstream's configuration is recorded as: every field but the keys.
AUDITED_FIELDS = (
    "kind",
    "url",
    "method",
    "timeout_seconds",
    "input_mode",
    "secret_env",
    "definitive_statuses",
    "max_result_bytes",
    "idempotent",
    "entry_point",
    "tool",
    "dry_run",
    "max_tries",
    "deadline_seconds",
)


def _audit_value(upstream: Upstream, name: str) -> Any:
    value = getattr(upstream, name)
    if name == "url" and value:
        # A URL may carry credentials (user:password@, a token in the query): never recorded.
        parts = urlsplit(str(value))
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        return f"{parts.scheme}://{netloc}{parts.path}" + ("?…" if parts.query else "")
    if isinstance(value, Decimal):
        return format(value.normalize(), "f")  # 5, 5.0 and 5.00 are one timeout
    return value


def upstream_audit_values(upstream: Upstream | None) -> dict[str, Any]:
    """The configuration as recorded on the timeline (JSON values, no secrets: the secret is
    only ever named by its variable, and a URL loses its credentials)."""
    if upstream is None:
        return {}
    return {name: _audit_value(upstream, name) for name in AUDITED_FIELDS}


def upstream_store(*, offering_id: int, upstream: Upstream | None) -> dict[str, list[Any]]:
    """Save (or, with None, remove) the offering's upstream; return what changed as
    {field: [before, after]} (empty: nothing did). Caller holds the offering's row lock."""
    from fulfillment.models import Upstream as UpstreamModel

    current = UpstreamModel.objects.select_for_update().filter(offering_id=offering_id).first()
    before = upstream_audit_values(current)
    if upstream is None:
        if current is not None:
            current.delete()
        after: dict[str, Any] = {}
    else:
        upstream.offering_id = offering_id
        upstream.pk = current.pk if current is not None else None
        after = upstream_audit_values(upstream)
        if after == before:
            return {}
        upstream.save()
    return {
        name: [before.get(name), after.get(name)]
        for name in AUDITED_FIELDS
        if before.get(name) != after.get(name)
    }
