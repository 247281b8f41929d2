"""Making the catalog equal to a catalog file, through the admin's own services
(offering_create, offering_update, offering_upstream_save): the same terms-version bumps and
the same audited `offering.*` events, each naming the file, its SHA-256 and who applied it.

All of it in one transaction: a file applies whole or not at all, and `--dry-run` is the
same apply rolled back, so what it prints is exactly what an apply would do."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import transaction

from backoffice.catalog.checks import Catalog, CatalogEntry
from backoffice.catalog.values import duration_text, money_text
from core.actors import Actor
from fulfillment.models import Upstream
from fulfillment.upstreams import AUDITED_FIELDS, upstream_audit_values
from purchases.models import Offering
from purchases.services.fulfil.upstreams import offering_upstream_save
from purchases.services.quote.offerings import offering_create, offering_update


@dataclass
class CatalogApplied:
    """What an apply did (or, dry, would do): the diff's lines and the slugs by outcome."""

    dry_run: bool
    lines: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    deactivated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    @property
    def changes(self) -> int:
        return len(self.created) + len(self.changed) + len(self.deactivated)


def value_text(name: str, value: Any, fields: dict[str, Any]) -> str:
    """A value as the file writes it, for the diff."""
    if name == "price":
        return money_text(
            int(value), symbol=str(fields["asset_symbol"]), decimals=int(fields["asset_decimals"])
        )
    if isinstance(value, timedelta):
        return duration_text(value)
    if isinstance(value, dict | list):
        text = json.dumps(value, sort_keys=True, separators=(",", ":"))
        return text if len(text) <= 80 else text[:77] + "..."
    return "null" if value is None else str(value)


def _upstream_changes(offering: Offering, entry: CatalogEntry) -> dict[str, list[Any]]:
    before = upstream_audit_values(Upstream.objects.filter(offering_id=offering.pk).first())
    after = upstream_audit_values(Upstream(**entry.upstream) if entry.upstream else None)
    return {
        name: [before.get(name), after.get(name)]
        for name in AUDITED_FIELDS
        if before.get(name) != after.get(name)
    }


def _create(
    entry: CatalogEntry, catalog: Catalog, actor: Actor, source: dict[str, Any]
) -> list[str]:
    owned = {"catalog_file": catalog.name, "catalog_sha256": catalog.sha256}
    offering = offering_create(
        fields={
            "slug": entry.slug,
            **entry.fields,
            **owned,
            "catalog_stock": entry.fields["stock"],
        },
        actor=actor,
        source=source,
    )
    price = value_text("price", offering.price, entry.fields)
    lines = [
        f"+ {entry.slug}: created, {price} on {offering.network}, executor {offering.executor}"
    ]
    if entry.upstream:
        version = offering_upstream_save(
            offering_id=offering.pk, upstream=Upstream(**entry.upstream), actor=actor, source=source
        )
        audit = upstream_audit_values(Upstream(**entry.upstream))
        lines.append(f"    upstream: {audit['kind']} {audit['url'] or audit['entry_point']}")
        lines.append(f"    terms version {version}")
    return lines


def _changes(offering: Offering, entry: CatalogEntry) -> dict[str, Any]:
    changes = {n: v for n, v in entry.fields.items() if getattr(offering, n) != v}
    if offering.catalog_sha256 and entry.fields["stock"] == offering.catalog_stock:
        changes.pop("stock", None)  # the file's number did not change: sales own the stock
    return changes


def _update(
    offering: Offering,
    entry: CatalogEntry,
    catalog: Catalog,
    actor: Actor,
    source: dict[str, Any],
) -> list[str] | None:
    changes = _changes(offering, entry)
    upstream = _upstream_changes(offering, entry)
    owned = {
        "catalog_file": catalog.name,
        "catalog_sha256": catalog.sha256,
        "catalog_stock": entry.fields["stock"],
    }
    owning = {n: v for n, v in owned.items() if getattr(offering, n) != v}
    if not (changes or upstream or owning):
        return None
    offering_update(
        offering_id=offering.pk, changes={**changes, **owning}, actor=actor, source=source
    )
    if upstream:
        offering_upstream_save(
            offering_id=offering.pk,
            upstream=Upstream(**entry.upstream) if entry.upstream else None,
            actor=actor,
            source=source,
        )
    version = Offering.objects.values_list("version", flat=True).get(pk=offering.pk)
    if not (changes or upstream):
        if offering.catalog_sha256:
            return []  # the file changed elsewhere: this offering only takes the new SHA-256
        return [f"~ {entry.slug}: now owned by {catalog.name} (nothing else changed)"]
    moved = f"terms version {offering.version} -> {version}" if version != offering.version else ""
    lines = [f"~ {entry.slug}: {moved or 'terms unchanged'}"]
    for name, value in sorted(changes.items()):
        before, after = (
            value_text(name, v, entry.fields) for v in (getattr(offering, name), value)
        )
        lines.append(f"    {name}: {before} -> {after}")
    for name, (before, after) in upstream.items():
        lines.append(f"    upstream.{name}: {before} -> {after}")
    return lines


def _prune(
    others: list[Offering],
    *,
    prune: bool,
    actor: Actor,
    source: dict[str, Any],
    done: CatalogApplied,
) -> None:
    for offering in others:
        if not offering.is_active:
            continue
        if not prune:
            done.kept.append(offering.slug)
            continue
        offering_update(
            offering_id=offering.pk,
            changes={
                "is_active": False,
                "catalog_file": "",
                "catalog_sha256": "",
                "catalog_stock": None,
            },
            actor=actor,
            source=source,
        )
        done.deactivated.append(offering.slug)
        done.lines.append(f"- {offering.slug}: deactivated (its quotes and purchases stay)")
    if done.kept:
        done.lines.append(
            f"  not in the file, left active (--prune deactivates them): {', '.join(done.kept)}"
        )


def catalog_apply(
    *, catalog: Catalog, actor: Actor, dry_run: bool = False, prune: bool = False
) -> CatalogApplied:
    """Make the catalog equal to the file: create what is missing, change what differs (its
    upstream included), and with `prune` deactivate active offerings the file does not name
    (never delete: quotes and purchases hang on them). A file's stock is written when the
    offering is created or the file's number changed since its last apply, never over what
    sales took since. With `dry_run` everything is done and rolled back.

    Raises ValueError only for a field one may not set (the checks make that a bug)."""
    source = {"file": catalog.name, "file_sha256": catalog.sha256}
    done = CatalogApplied(dry_run=dry_run)
    with transaction.atomic():
        # Every offering locked, in pk order: two applies (or an apply and an admin save)
        # take turns instead of interleaving.
        current = {o.slug: o for o in Offering.objects.select_for_update().order_by("pk")}
        for slug in sorted(catalog.entries):
            entry, offering = catalog.entries[slug], current.get(slug)
            if offering is None:
                done.lines.extend(_create(entry, catalog, actor, source))
                done.created.append(slug)
                continue
            lines = _update(offering, entry, catalog, actor, source)
            if lines:
                done.lines.extend(lines)
                done.changed.append(slug)
            else:
                done.unchanged.append(slug)
        others = [o for slug, o in current.items() if slug not in catalog.entries]
        _prune(others, prune=prune, actor=actor, source=source, done=done)
        if dry_run:
            transaction.set_rollback(True)
    return done
