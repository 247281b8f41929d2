"""Which executor runs an offering's work, and with which upstream configuration."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import F

from core.actors import Actor
from core.locks import lock_one
from fulfillment.executors import JobSpec, UpstreamSpec
from fulfillment.models import Upstream
from fulfillment.upstream_check import UpstreamCheck, upstream_check
from fulfillment.upstreams import upstream_spec, upstream_store
from purchases import event_subjects
from purchases.events import event_record
from purchases.models import Offering, Purchase


def offering_executor(offering: Offering) -> tuple[str, UpstreamSpec | None]:
    """The executor's name and the offering's upstream, if it has one. Without an upstream
    the offering's `executor` name is used as before (report; http_job on JOB_SERVICE_URL).
    Read the offering with `select_related("offering__upstream")` to spare a query."""
    if getattr(offering, "has_upstream", None) is False:  # read with the paid route
        return offering.executor, None
    upstream = getattr(offering, "upstream", None)  # the reverse one-to-one, or None
    if upstream is None:
        return offering.executor, None
    spec = upstream_spec(upstream)
    return spec.executor_name, spec


def purchase_job_spec(
    *, purchase: Purchase, idempotency_key: str, upstream: UpstreamSpec | None
) -> JobSpec:
    """What the executor is handed for the purchase's work: the same key on every try, so a
    second `start` finds the first job."""
    return JobSpec(
        purchase_ref=purchase.ref,
        operation=purchase.offering.slug,
        input=purchase.quote.canonical_input,
        idempotency_key=idempotency_key,
        upstream=upstream,
    )


def offering_upstream_check(*, slug: str) -> UpstreamCheck:
    """Check the offering's upstream (fulfillment.upstream_check); an offering without one is
    reported as such. Raises Offering.DoesNotExist for an unknown slug."""
    offering = Offering.objects.select_related("upstream").get(slug=slug)
    name, spec = offering_executor(offering)
    if spec is None:
        check = UpstreamCheck()
        check.note("upstream", f"none: the built-in executor {name!r} runs the work")
        return check
    return upstream_check(spec)


def offering_upstream_save(
    *,
    offering_id: int,
    upstream: Upstream | None,
    actor: Actor,
    source: dict[str, Any] | None = None,
) -> int:
    """Save (or, with None, remove) the offering's upstream as staff edited it, and return
    the offering's terms version. A change is a new version of the terms (where the paid
    work runs is part of what a quote sells) and an event naming who changed what (no
    secret: they are only named by variable), both in the transaction of the change.
    `source`: what a catalog file's apply adds to the event (the file's name and SHA-256)."""
    with transaction.atomic():
        offering = lock_one(Offering, offering_id)
        changed = upstream_store(offering_id=offering_id, upstream=upstream)
        if not changed:
            return offering.version
        Offering.objects.filter(pk=offering_id).update(version=F("version") + 1)
        version = Offering.objects.values_list("version", flat=True).get(pk=offering_id)
        existed = any(before is not None for before, _ in changed.values())
        event_record(
            subject=event_subjects.OFFERING_UPSTREAM_CHANGED,
            actor=actor,
            from_state=str(offering.version),
            to_state=str(version),
            reason_code=(
                "upstream_removed"
                if upstream is None
                else ("upstream_changed" if existed else "upstream_added")
            ),
            evidence={"offering": offering.slug, "changed": changed, **(source or {})},
        )
        return version
