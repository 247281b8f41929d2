"""The duplicate window: a re-signed retry is answered with the purchase it repeats.

Stock x402 clients never resend a payment: after a timeout they sign a new authorization
(new nonce) against a new 402. Only the seller can tell it is the same purchase: the same
payer (and API key, when one is sent) asking for the same offering with the same canonical
input. Inside the offering's duplicate window such a payment is answered with the existing
purchase and never broadcast; its authorization expires unused. A deliberate second copy
carries a copy label (the API's `Tollbooth-Copy` header), which is part of the identity, so
a retried copy is still deduplicated against itself.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from django.db.models import CharField, OuterRef, Subquery, Value
from django.db.models.functions import SHA256, Concat

from core.actors import Actor
from core.errors import DomainError, ErrorCode
from purchases.events import event_record
from purchases.models import DuplicateGuard, Offering, Purchase, Quote
from purchases.selectors import purchases_repeated
from purchases.services.checkout.duplicate_reads import duplicate_key_for_slug
from purchases.services.quote.quotes import quote_expire
from purchases.sql import duplicate_guard_upsert

_COPY_LABEL = re.compile(r"[A-Za-z0-9_-]{1,64}")


def copy_label_validate(*, label: str | None) -> str:
    """Raises DomainError: copy_label_invalid."""
    if label is None:
        return ""
    if not _COPY_LABEL.fullmatch(label):
        raise DomainError(ErrorCode.COPY_LABEL_INVALID)
    return label


def duplicate_key_for(
    *, payer: str, buyer_ref: str | None, offering: Offering, input_hash: str, copy_label: str
) -> str:
    return duplicate_key_for_slug(
        payer=payer,
        buyer_ref=buyer_ref,
        offering_slug=offering.slug,
        input_hash=input_hash,
        copy_label=copy_label,
    )


class _Sha256Hex(SHA256):
    """Hex SHA-256 of a text, as core.canonical.sha256_hex computes it (duplicate_key_for_slug's
    key, computed by the database from the quote's own columns). On PostgreSQL with
    the built-in sha256() (Django's SHA256 there needs the pgcrypto extension)."""

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return super().as_sql(
            compiler,
            connection,
            template="encode(sha256(convert_to(%(expressions)s, 'UTF8')), 'hex')",
            **extra,
        )


def purchase_duplicate_of_quote(
    *, payer: str, buyer_ref: str | None, copy_label: str, now: datetime
) -> Subquery:
    """For annotating a Quote query (the offering joined): the id of the purchase a payment
    of that quote would repeat, as purchase_duplicate_find says, with the key computed by
    the database (SHA256 of the same fields), so reading the quote looks for it too."""
    # The values each a parameter of their own, so the statement's shape never changes
    # (checkout compiles it once: core.prepared).
    key = _Sha256Hex(
        Concat(
            Value(payer.lower()),
            Value("|"),
            Value(buyer_ref or ""),
            Value("|"),
            OuterRef("offering__slug"),
            Value("|"),
            OuterRef("input_hash"),
            Value("|"),
            Value(copy_label),
            output_field=CharField(),
        )
    )
    repeated = purchases_repeated(
        offering_id=OuterRef("offering_id"),
        window=OuterRef("offering__duplicate_window"),
        duplicate_key=key,
        now=now,
    )
    return Subquery(repeated.values("pk")[:1])


def duplicate_guard_lock(*, duplicate_key: str, now: datetime) -> bool:
    """Serialize payments for one duplicate key until the caller's transaction ends.

    One upsert takes the row lock and stamps the guard's last use (`created_at`), never a
    failing INSERT. Returns True when the guard is new: no payment for this key was decided
    since guards were last pruned (never within a duplicate window), so there is nothing
    to look for.
    """
    return duplicate_guard_upsert(key=duplicate_key, now=now)


def purchase_duplicate_record(
    *, purchase: Purchase, actor: Actor, rail: str, evidence: dict[str, object]
) -> None:
    """Put the answered duplicate on the purchase's timeline (nothing about it changes)."""
    event_record(
        subject="purchase.duplicate",
        purchase=purchase,
        actor=actor,
        reason_code="duplicate_answered",
        evidence={"rail": rail, **evidence},
    )


def quote_release_if_unpaid(*, quote: Quote, actor: Actor) -> None:
    """A retry's own quote will never be paid: close it and give back the stock it holds."""
    locked = Quote.objects.select_for_update().get(pk=quote.pk)
    if locked.state == Quote.State.OPEN and not Purchase.objects.filter(quote=locked).exists():
        quote_expire(quote=locked, actor=actor)


def duplicate_guards_prune(*, before: datetime, batch: int = 5000) -> int:
    """Delete guard rows last used before `before`, batch by batch. A guard is only a lock
    row (the purchases themselves carry the duplicate key), so a later payment re-creates
    it; `before` must lie further back than every offering's duplicate window, since a new
    guard means "nothing to look for"."""
    pruned = 0
    while True:
        ids = list(
            DuplicateGuard.objects.filter(created_at__lt=before).values_list("pk", flat=True)[
                :batch
            ]
        )
        pruned += DuplicateGuard.objects.filter(pk__in=ids).delete()[0] if ids else 0
        if len(ids) < batch:
            return pruned
