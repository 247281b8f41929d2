"""The duplicate-window look-up (purchases.services.checkout.duplicates) for a payment whose
quote is not written yet (an anonymous quote signed into its 402:
purchases.services.x402.quote_seal): read with the offering, the key computed here from the
signed input hash."""

from __future__ import annotations

from datetime import datetime

from django.db.models import OuterRef, Subquery

from core.canonical import sha256_hex
from purchases.selectors import purchases_repeated


def duplicate_key_for_slug(
    *, payer: str, buyer_ref: str | None, offering_slug: str, input_hash: str, copy_label: str
) -> str:
    """The duplicate key: who pays (the wallet, and the API key's buyer when one is sent) for
    what (the offering, the canonical input's hash) and which copy."""
    return sha256_hex(
        "|".join([payer.lower(), buyer_ref or "", offering_slug, input_hash, copy_label])
    )


def purchase_duplicate_of_offering(*, duplicate_key: str, now: datetime) -> Subquery:
    """For annotating an Offering query: the id of the purchase a payment with this duplicate
    key would repeat, as purchase_duplicate_find says (None: none, or the window is off)."""
    repeated = purchases_repeated(
        offering_id=OuterRef("pk"),
        window=OuterRef("duplicate_window"),
        duplicate_key=duplicate_key,
        now=now,
    )
    return Subquery(repeated.values("pk")[:1])
