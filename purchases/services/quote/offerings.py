"""What is sold: changes to an offering go through here, so its terms version is never typed
by hand."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F

from core.actors import Actor
from purchases import event_subjects
from purchases.events import event_record
from purchases.models import Offering

# Fields a buyer's quote depends on: changing any of them is a new version of the terms.
TERM_FIELDS = frozenset(
    {
        "price",
        "asset",
        "asset_decimals",
        "network",
        "pay_to",
        "input_schema",
        "volatile_fields",
        "executor",
        "result_retention",
        "refund_policy",
        "delivery_condition",
        "irreversible",
        "late_payment_policy",
        "duplicate_window",
        "max_input_bytes",
    }
)
# Which catalog file owns the offering (backoffice/catalog): not terms.
CATALOG_FIELDS = frozenset({"catalog_file", "catalog_sha256", "catalog_stock"})


def _audit(value: Any) -> Any:
    """A field's value as the timeline records it (JSON)."""
    if isinstance(value, timedelta):
        return int(value.total_seconds())
    if isinstance(value, Decimal):
        return format(value.normalize(), "f")
    return value


def _settable(fields: dict[str, Any]) -> None:
    refused = (set(fields) - {f.name for f in Offering._meta.concrete_fields}) | (
        {"version", "id"} & set(fields)
    )
    if refused:
        raise ValueError(f"not offering fields one may set: {sorted(refused)}")


def offering_asset_problem(*, network: str, asset: str) -> str:
    """Why the asset cannot be sold on the network ("" when it can): x402 buyers sign for
    the asset we name and we settle the network's token, so on a network with a token the
    asset must be that token. One rule for the admin's form and the catalog file."""
    token = str((settings.X402_NETWORKS.get(str(network)) or {}).get("token_address") or "")
    if token and asset and str(asset).lower() != token.lower():
        return (
            f"On {network} x402 payments are in the network's token {token}: "
            "the asset must be that address, or no x402 payment could settle."
        )
    return ""


def offering_create(
    *, fields: dict[str, Any], actor: Actor, source: dict[str, Any] | None = None
) -> Offering:
    """Create an offering (terms version 1) and record `offering.created` naming who did it
    and, for a catalog file, which file (`source`). Fields are validated by the caller (the
    admin's form, the catalog file's checks). Raises ValueError for a field one may not set."""
    _settable(fields)
    with transaction.atomic():
        offering = Offering.objects.create(**fields)
        event_record(
            subject=event_subjects.OFFERING_CREATED,
            actor=actor,
            to_state=str(offering.version),
            reason_code="offering_created",
            evidence={
                "offering": offering.slug,
                "fields": {name: _audit(value) for name, value in sorted(fields.items())},
                **(source or {}),
            },
        )
        return offering


def offering_update(
    *,
    offering_id: int,
    changes: dict[str, Any],
    actor: Actor,
    source: dict[str, Any] | None = None,
) -> Offering:
    """Write only the edited columns, bump `version` when the terms change, and record
    `offering.changed` (who, what before -> after, and for a catalog file which file).

    Only the named columns: a full-row save would put back stock that quotes took (by a
    conditional decrement) while the page was open, and oversell. Raises ValueError for a
    field one may not set.
    """
    _settable(changes)
    with transaction.atomic():
        current = Offering.objects.select_for_update().get(pk=offering_id)
        # Forms report a JSON field as edited when only its formatting differs: compare values.
        edited = {name: value for name, value in changes.items() if getattr(current, name) != value}
        if not edited:
            return current
        bump = {"version": F("version") + 1} if TERM_FIELDS & set(edited) else {}
        Offering.objects.filter(pk=offering_id).update(**edited, **bump)
        updated = Offering.objects.get(pk=offering_id)
        # The catalog file's own bookkeeping is not a change of what is sold.
        audited = sorted(set(edited) - CATALOG_FIELDS)
        if audited:
            event_record(
                subject=event_subjects.OFFERING_CHANGED,
                actor=actor,
                from_state=str(current.version),
                to_state=str(updated.version),
                reason_code="terms_changed" if bump else "offering_changed",
                evidence={
                    "offering": current.slug,
                    "changed": {
                        name: [_audit(getattr(current, name)), _audit(edited[name])]
                        for name in audited
                    },
                    **(source or {}),
                },
            )
        return updated


def offering_stock_take(*, offering_id: int) -> bool:
    """Take one unit if one is free: a conditional decrement, so stock never goes below zero
    whatever races. Returns False when sold out. The one place stock goes down."""
    return bool(Offering.objects.filter(pk=offering_id, stock__gt=0).update(stock=F("stock") - 1))


def offering_stock_release(*, offering_id: int) -> None:
    """Give one unit back (a quote expired or a purchase was voided). The one place stock
    goes up, besides a person restocking in the admin."""
    Offering.objects.filter(pk=offering_id, stock__isnull=False).update(stock=F("stock") + 1)
