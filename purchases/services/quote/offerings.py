"""What is sold: changes to an offering go through here, so its terms version is never typed
by hand."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import F

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


def offering_update(*, offering_id: int, changes: dict[str, Any]) -> Offering:
    """Write only the edited columns, and bump `version` when the terms change.

    Only the named columns: a full-row save would put back stock that quotes took (by a
    conditional decrement) while the page was open, and oversell.
    """
    refused = (set(changes) - {f.name for f in Offering._meta.concrete_fields}) | (
        {"version", "id"} & set(changes)
    )
    if refused:
        raise ValueError(f"not offering fields one may set: {sorted(refused)}")
    with transaction.atomic():
        current = Offering.objects.select_for_update().get(pk=offering_id)
        # Forms report a JSON field as edited when only its formatting differs: compare values.
        edited = {name: value for name, value in changes.items() if getattr(current, name) != value}
        if not edited:
            return current
        bump = {"version": F("version") + 1} if TERM_FIELDS & set(edited) else {}
        Offering.objects.filter(pk=offering_id).update(**edited, **bump)
        return Offering.objects.get(pk=offering_id)


def offering_stock_take(*, offering_id: int) -> bool:
    """Take one unit if one is free: a conditional decrement, so stock never goes below zero
    whatever races. Returns False when sold out. The one place stock goes down."""
    return bool(Offering.objects.filter(pk=offering_id, stock__gt=0).update(stock=F("stock") - 1))


def offering_stock_release(*, offering_id: int) -> None:
    """Give one unit back (a quote expired or a purchase was voided). The one place stock
    goes up, besides a person restocking in the admin."""
    Offering.objects.filter(pk=offering_id, stock__isnull=False).update(stock=F("stock") + 1)
