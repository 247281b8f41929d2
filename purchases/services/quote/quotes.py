"""Quotes: validated, canonical, idempotent per (buyer, offering, input), holding stock."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jsonschema
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Exists, OuterRef

from core.actors import Actor
from core.bulk import insert_unless_conflict
from core.canonical import canonical_json, sha256_hex, strip_volatile
from core.clock import now_or
from core.errors import DomainError, ErrorCode
from core.prepared import PreparedQuery
from core.refs import new_ref
from fulfillment.executors.passthrough import request_from_input
from fulfillment.models import Upstream
from payments.rails import QuoteTerms
from payments.rails.x402.networks import network_config
from purchases.events import event_record
from purchases.models import Buyer, Offering, Purchase, PurchaseEvent, Quote
from purchases.services.quote.offerings import offering_stock_release, offering_stock_take
from purchases.services.quote.top_ups import (
    offering_is_top_up,
    top_up_input_canonicalize,
    top_up_price,
)
from purchases.sql import event_after_insert


@dataclass(frozen=True)
class QuoteOutcome:
    quote: Quote
    created: bool


# Every quote and every paid call reads its offering: compiled once per process. Whether its
# upstream passes the paid request through comes in the same statement (the input's shape).
_ACTIVE_OFFERING = PreparedQuery(
    lambda slug: (
        Offering.objects.filter(slug=slug, is_active=True)
        .annotate(
            passes_request=Exists(
                Upstream.objects.filter(
                    offering_id=OuterRef("pk"), input_mode=Upstream.InputMode.REQUEST
                )
            )
        )
        .order_by("pk")[:1]
    ),
    slug=str,
)


def offering_get_active(*, slug: str) -> Offering:
    offering = _ACTIVE_OFFERING.first(slug=slug)
    if offering is None:
        raise DomainError(ErrorCode.OFFERING_NOT_FOUND, f"No offering named {slug!r}.")
    return offering


def quote_input_canonicalize(*, offering: Offering, raw_input: Any) -> dict[str, Any]:
    """Check the size, validate against the offering's schema, then strip volatile fields.

    Raises DomainError: input_too_large, invalid_input (listing every schema violation).
    """
    if offering_is_top_up(offering):
        return top_up_input_canonicalize(raw_input=raw_input)
    if not isinstance(raw_input, dict):
        raise DomainError(ErrorCode.INVALID_INPUT, "The input must be a JSON object.")
    # Measured before the schema runs, so an oversized input costs no validation either.
    size = len(canonical_json(raw_input).encode("utf-8", "surrogatepass"))
    if size > offering.max_input_bytes:
        raise DomainError(
            ErrorCode.INPUT_TOO_LARGE,
            f"The input is {size} bytes of JSON; {offering.slug} takes at most "
            f"{offering.max_input_bytes}.",
            extra={"input_bytes": size, "max_input_bytes": offering.max_input_bytes},
        )
    validator = jsonschema.Draft202012Validator(offering.input_schema or {})
    errors = sorted(validator.iter_errors(raw_input), key=lambda e: list(e.absolute_path))
    if errors:
        raise DomainError(
            ErrorCode.INVALID_INPUT,
            extra={
                "errors": [
                    {"path": "/".join(map(str, e.absolute_path)), "message": e.message}
                    for e in errors[:20]
                ]
            },
        )
    if getattr(offering, "passes_request", False):
        try:
            request_from_input(raw_input)
        except (ValueError, TypeError) as exc:
            # Another door's input would be refused by the worker after payment: refuse it
            # before anything is quoted.
            raise DomainError(
                ErrorCode.INVALID_INPUT,
                f"{offering.slug} sells calls of an API: buy a path below its paid URL, "
                f"/x402/{offering.slug}/<path>.",
            ) from exc
    return strip_volatile(raw_input, list(offering.volatile_fields or []))


def quote_key_for(*, buyer: Buyer | None, offering: Offering, input_hash: str) -> str:
    principal = buyer.ref if buyer else "anonymous"
    return sha256_hex(f"{principal}|{offering.slug}|{offering.version}|{input_hash}")


def quote_create(
    *, buyer: Buyer, offering_slug: str, raw_input: Any, now: datetime | None = None
) -> QuoteOutcome:
    """Return the buyer's open quote for this canonical input, or open a new one.

    Raises DomainError: offering_not_found, invalid_input, sold_out.
    """
    now = now_or(now)
    offering = offering_get_active(slug=offering_slug)
    canonical = quote_input_canonicalize(offering=offering, raw_input=raw_input)
    input_hash = sha256_hex(canonical_json(canonical))
    key = quote_key_for(buyer=buyer, offering=offering, input_hash=input_hash)
    for _ in range(3):
        try:
            return _quote_find_or_open(
                buyer=buyer,
                offering=offering,
                canonical=canonical,
                input_hash=input_hash,
                key=key,
                now=now,
            )
        except IntegrityError:
            continue  # a racing request opened the same quote first: read theirs
    raise RuntimeError("quote creation kept racing")  # pragma: no cover - needs three lost races


@transaction.atomic
def _quote_find_or_open(
    *,
    buyer: Buyer,
    offering: Offering,
    canonical: dict[str, Any],
    input_hash: str,
    key: str,
    now: datetime,
) -> QuoteOutcome:
    holds_stock = offering.stock is not None
    if not holds_stock:
        # The common case in one statement: open it unless the key already has an open quote
        # (the partial unique index decides; no failing INSERT). Then read that one below.
        quote = _quote_new(
            buyer=buyer,
            offering=offering,
            canonical=canonical,
            input_hash=input_hash,
            key=key,
            now=now,
            holds_stock=False,
        )
        # Its event goes in the same statement where the database can (PostgreSQL).
        also = event_after_insert(_quote_opened_event(quote, offering, buyer), about="quote")
        if insert_unless_conflict(quote, conflict="(quote_key) WHERE state = 'open'", also=also):
            if also is None:
                _quote_note_opened(quote, offering, buyer)
            return QuoteOutcome(quote, created=True)
    existing = (
        Quote.objects.select_for_update().filter(quote_key=key, state=Quote.State.OPEN).first()
    )
    if existing is not None and existing.expires_at > now:
        return QuoteOutcome(existing, created=False)
    if existing is not None:
        quote_expire(quote=existing, actor=Actor.system())
    if holds_stock and not offering_stock_take(offering_id=offering.pk):
        raise DomainError(ErrorCode.SOLD_OUT)
    quote = _quote_new(
        buyer=buyer,
        offering=offering,
        canonical=canonical,
        input_hash=input_hash,
        key=key,
        now=now,
        holds_stock=holds_stock,
    )
    quote.save(force_insert=True)
    _quote_note_opened(quote, offering, buyer)
    return QuoteOutcome(quote, created=True)


def _quote_new(
    *,
    buyer: Buyer,
    offering: Offering,
    canonical: dict[str, Any],
    input_hash: str,
    key: str,
    now: datetime,
    holds_stock: bool,
) -> Quote:
    return Quote(
        public_id=new_ref("qt"),
        offering=offering,
        buyer=buyer,
        quote_key=key,
        canonical_input=canonical,
        input_hash=input_hash,
        price=top_up_price(offering=offering, canonical_input=canonical),
        asset=offering.asset,
        network=offering.network,
        pay_to=offering.pay_to,
        offering_version=offering.version,
        holds_stock=holds_stock,
        expires_at=now + settings.TOLLBOOTH["QUOTE_TTL"],
    )


def _quote_opened_evidence(quote: Quote, offering: Offering) -> dict[str, Any]:
    return {
        "offering": offering.slug,
        "price": str(quote.price),
        "input_hash": quote.input_hash,
        "holds_stock": quote.holds_stock,
    }


def _quote_opened_event(quote: Quote, offering: Offering, buyer: Buyer) -> PurchaseEvent:
    actor = Actor.agent(buyer.ref)
    return PurchaseEvent(
        subject="quote",
        actor_type=actor.type,
        actor=actor.name,
        to_state=Quote.State.OPEN,
        evidence=_quote_opened_evidence(quote, offering),
    )


def _quote_note_opened(quote: Quote, offering: Offering, buyer: Buyer) -> None:
    event_record(
        subject="quote",
        quote=quote,
        actor=Actor.agent(buyer.ref),
        to_state=quote.state,
        evidence=_quote_opened_evidence(quote, offering),
    )


def quote_expire(*, quote: Quote, actor: Actor) -> None:
    """Close an open quote and give its stock back. Caller holds the quote row lock."""
    released = quote.holds_stock
    quote.expire()
    quote.save(update_fields=["state", "holds_stock"])
    if released:
        offering_stock_release(offering_id=quote.offering_id)
    event_record(
        subject="quote",
        quote=quote,
        actor=actor,
        from_state=Quote.State.OPEN,
        to_state=quote.state,
        reason_code="quote_expired",
        evidence={"stock_released": released},
    )


def quotes_purge_expired_batch(*, expired_before: datetime, batch: int) -> tuple[int, int]:
    """Delete up to `batch` quotes that expired unpaid before `expired_before`, and their own
    events (a quote that never became a purchase is on no purchase's timeline).

    Returns (quotes deleted, events deleted). Rows another run holds are skipped.
    """
    with transaction.atomic():
        ids = list(
            Quote.objects.select_for_update(skip_locked=True)
            .filter(state=Quote.State.EXPIRED, expires_at__lt=expired_before)
            .exclude(Exists(Purchase.objects.filter(quote_id=OuterRef("pk"))))
            .order_by("pk")
            .values_list("pk", flat=True)[:batch]
        )
        if not ids:
            return 0, 0
        events, _ = PurchaseEvent.objects.filter(quote_id__in=ids, purchase__isnull=True).delete()
        quotes, _ = Quote.objects.filter(pk__in=ids).delete()  # PROTECT guards any purchase
    return quotes, events


def quote_terms(*, quote: Quote) -> QuoteTerms:
    """What the quote asks of the payer, as the rails take it."""
    return QuoteTerms(
        quote_id=quote.public_id,
        network=quote.network,
        asset=quote.asset,
        amount=quote.price,
        pay_to=quote.pay_to,
        duplicate_window_seconds=int(quote.offering.duplicate_window.total_seconds()),
        payment_flow=offering_payment_flow(offering=quote.offering),
        max_timeout_seconds=offering_payment_window(offering=quote.offering),
    )


def offering_payment_flow(*, offering: Offering) -> str:
    """The x402 payment flow (x402 #3053) an offering's 402 announces: `authorization` when
    it settles after the work, else `upfront` (settled, or verified and broadcast, first)."""
    if offering.settles_after_work:
        return "authorization"
    return "upfront"


def offering_payment_window(*, offering: Offering) -> int | None:
    """The authorization flow's maxTimeoutSeconds: the work's deadline, the settle margin
    and the network's confirmation timeout, capped by AUTHORIZATION_MAX_WINDOW. None (the
    network's default) for an upfront offering."""
    if not offering.settles_after_work:
        return None
    tollbooth = settings.TOLLBOOTH
    deadline = tollbooth["EXECUTION_DEADLINE"].total_seconds()
    upstream = getattr(offering, "upstream", None)
    if upstream is not None and upstream.deadline_seconds:
        deadline = upstream.deadline_seconds
    window = (
        deadline
        + tollbooth["AUTHORIZATION_SETTLE_MARGIN"].total_seconds()
        + network_config(offering.network).confirmation_timeout
    )
    return int(min(window, tollbooth["AUTHORIZATION_MAX_WINDOW"].total_seconds()))
