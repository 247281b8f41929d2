"""Per-offering upstreams: the frozen value an executor gets (UpstreamSpec), the configuration
as the timeline records it, and the one write that stores it. The configuration's rules are
the model's own (fulfillment.models.upstream_validate, run by Upstream.clean)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit

from fulfillment.executors.base import UpstreamSpec
from fulfillment.models import Upstream


def upstream_spec(upstream: Upstream) -> UpstreamSpec:
    """The frozen value an executor gets, read from the row at claim time."""
    return UpstreamSpec(
        kind=upstream.kind,
        url=upstream.url,
        method=str(upstream.method).upper(),
        timeout=float(upstream.timeout_seconds),
        input_mode=upstream.input_mode,
        secret_env=upstream.secret_env,
        key_id=upstream.key_id,
        previous_secret_env=upstream.previous_secret_env,
        previous_key_id=upstream.previous_key_id,
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
    "key_id",
    "previous_secret_env",
    "previous_key_id",
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
    current = Upstream.objects.select_for_update().filter(offering_id=offering_id).first()
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
