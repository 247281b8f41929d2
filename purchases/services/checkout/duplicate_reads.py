"""The duplicate-window look-up (purchases.services.checkout.duplicates) for a payment whose
quote is not written yet (an anonymous quote signed into its 402:
purchases.services.x402.quote_seal): read with the offering, the key computed here from the
signed input hash."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import DateTimeField, ExpressionWrapper, OuterRef, Subquery, Value
from django.db.models.lookups import GreaterThan

from core.canonical import sha256_hex
from purchases.models import Purchase
from purchases.selectors import DUPLICATE_REPEATABLE_STATES as REPEATABLE_STATES


def duplicate_key_for_slug(
    *, payer: str, buyer_ref: str | None, offering_slug: str, input_hash: str, copy_label: str
) -> str:
    """purchases.services.checkout.duplicates.duplicate_key_for, by the offering's slug."""
    return sha256_hex(
        "|".join([payer.lower(), buyer_ref or "", offering_slug, input_hash, copy_label])
    )


def purchase_duplicate_of_offering(*, duplicate_key: str, now: datetime) -> Subquery:
    """For annotating an Offering query: the id of the purchase a payment with this duplicate
    key would repeat, as purchase_duplicate_find says (None: none, or the window is off)."""
    since = ExpressionWrapper(
        Value(now, output_field=DateTimeField()) - OuterRef("duplicate_window"),
        output_field=DateTimeField(),
    )
    repeated = Purchase.objects.filter(
        GreaterThan(OuterRef("duplicate_window"), Value(timedelta(0))),
        offering_id=OuterRef("pk"),
        duplicate_key=duplicate_key,
        created_at__gt=since,
        payment_state__in=REPEATABLE_STATES,
    ).order_by("-pk")
    return Subquery(repeated.values("pk")[:1])
