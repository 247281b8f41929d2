"""What an x402 buyer is offered before paying (answered 402 by doors.x402.answers),
and the catalogue of paid URLs.

An offer for a given input names the quote it opened (`accepts[].extra.quote`). An offer
without usable input (a bare GET, any HEAD) is price-only: the requirements without a quote,
so tools that only read offers can grade the URL, and nothing is written for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef, Subquery

from core.actors import Actor
from core.canonical import canonical_json
from core.clock import now_or
from core.errors import DomainError, ErrorCode
from core.prepared import PreparedQuery
from fulfillment.executors.passthrough import METHODS as PASSED_METHODS
from fulfillment.models import Upstream
from payments.rails.x402.discovery import BAZAAR_KEY, bazaar_declaration, input_example
from payments.rails.x402.networks import UnknownNetwork, network_config, network_is_settled
from payments.rails.x402.sign_in import SignInChallenge, sign_in_declaration
from payments.rails.x402.types import NetworkConfig
from payments.rails.x402.wire import payment_required_header, requirements_wire
from purchases.events import event_record
from purchases.models import Buyer, BuyerWallet, Offering, Quote
from purchases.services.checkout.duplicate_reads import (
    duplicate_key_for_slug,
    purchase_duplicate_of_offering,
)
from purchases.services.quote.quotes import (
    offering_get_active,
    quote_create,
    quote_input_canonicalize,
)
from purchases.services.quote.top_ups import (
    offering_input_schema,
    offering_is_top_up,
    top_up_require_buyer,
)
from purchases.services.x402.outcomes import x402_requirements, x402_requirements_for_offering
from purchases.services.x402.quote_seal import quote_seal, quote_unwritten
from purchases.services.x402.tool_offers import mcp_discovery_items

# The largest bazaar description a 402 carries (JSON characters): echoed in base64 beside the
# sign-in challenge (about 1.3 KB of JSON) it leaves an honest payment (about 2 KB) well
# inside MAX_PAYMENT_SIGNATURE_CHARS (16 KB).
BAZAAR_402_MAX_CHARS = 6_000
# JSON-schema scalar types a query-string value can be read as (GET buys).
_QUERY_SCALARS = {"string", "integer", "boolean"}


@dataclass(frozen=True)
class X402Offer:
    """What a buyer is asked to pay: the PaymentRequired `document` and its wire encoding.

    `quote`: the public id of the quote it opened; None for a price-only offer, which says
    what input the offering takes (`input_schema`) and what was wrong with the one sent.
    """

    payment_required: str  # `document`, encoded for the wire
    document: dict[str, Any]
    quote: str | None
    input_schema: dict[str, Any] | None = None
    input_errors: list[Any] | None = None


@dataclass(frozen=True)
class X402Route:
    offering: Offering
    network: NetworkConfig


@dataclass(frozen=True)
class X402PaidRoute:
    """The paid URL's offering and what the payment's quote asks for: the input hash of the
    quote `accepted.extra.quote` names (None: no such quote of this offering). No network
    configuration: the rail derives it once, for the whole payment (payments.rails.x402.context).

    Read for a quote not yet written (its terms signed in the payment), also what its read
    would otherwise bring: the purchase this payment would repeat (`duplicate_id`) and the
    buyer the paying wallet is registered to (`payer_owner_id`)."""

    offering: Offering
    quote_input_hash: str | None
    duplicate_id: int | None = None
    payer_owner_id: int | None = None


# Every paid request reads its offering; the named quote's input hash comes in the same
# statement (what a payment id binds to needs it before the id is claimed), and whether a
# seller's upstream runs the work (purchases.services.fulfil.upstreams: no second read to decide
# whether the request may run the work itself).
_PAID_OFFERING = PreparedQuery(
    lambda slug, quote: (
        Offering.objects.filter(slug=slug, is_active=True)
        .annotate(
            quote_input_hash=Subquery(
                Quote.objects.filter(public_id=quote, offering_id=OuterRef("pk")).values(
                    "input_hash"
                )[:1]
            ),
            has_upstream=Exists(Upstream.objects.filter(offering_id=OuterRef("pk"))),
        )
        .order_by("pk")[:1]
    ),
    slug=str,
    quote=str,
)


# The same for a payment of a quote whose terms it carries signed
# (purchases.services.x402.quote_seal):
# with the duplicate it would repeat and the paying wallet's owner, so the quote's
# terms, duplicate and owner come in this one read (no quote row to read them with).
_PAID_OFFERING_SEALED = PreparedQuery(
    lambda slug, quote, payer, duplicate_key, now: (
        Offering.objects.filter(slug=slug, is_active=True)
        .annotate(
            quote_input_hash=Subquery(
                Quote.objects.filter(public_id=quote, offering_id=OuterRef("pk")).values(
                    "input_hash"
                )[:1]
            ),
            has_upstream=Exists(Upstream.objects.filter(offering_id=OuterRef("pk"))),
            duplicate_id=purchase_duplicate_of_offering(duplicate_key=duplicate_key, now=now),
            payer_owner_id=Subquery(
                BuyerWallet.objects.filter(address=payer).values("buyer_id")[:1]
            ),
        )
        .order_by("pk")[:1]
    ),
    slug=str,
    quote=str,
    payer=str,
    duplicate_key=str,
    now=datetime,
)

_NOT_X402 = "This offering is not sold over x402."


def x402_route(*, offering_slug: str) -> X402Route:
    """Raises DomainError: offering_not_found (also for an offering on no x402 network)."""
    return _route(offering_get_active(slug=offering_slug))


def x402_route_paid(*, offering_slug: str, quote_id: str | None) -> X402PaidRoute:
    """The route, with the input hash of the quote the payment names, in one read.

    Raises DomainError: offering_not_found.
    """
    offering = _PAID_OFFERING.first(slug=offering_slug, quote=quote_id or "")
    if offering is None:
        raise DomainError(ErrorCode.OFFERING_NOT_FOUND, f"No offering named {offering_slug!r}.")
    if not network_is_settled(offering.network):
        raise DomainError(ErrorCode.OFFERING_NOT_FOUND, _NOT_X402)
    return X402PaidRoute(offering, offering.quote_input_hash)  # type: ignore[attr-defined]


def x402_route_paid_sealed(
    *,
    offering_slug: str,
    quote_id: str,
    payer: str,
    buyer_ref: str | None,
    input_hash: str,
    copy_label: str,
    now: datetime,
) -> X402PaidRoute:
    """x402_route_paid for a payment carrying its quote's signed terms: with the duplicate
    (as purchase_duplicate_find finds it for this payer, key, input and copy label) and the
    paying wallet's owner. `input_hash`: the signed one (the seal is checked by the caller).

    Raises DomainError: offering_not_found.
    """
    key = duplicate_key_for_slug(
        payer=payer,
        buyer_ref=buyer_ref,
        offering_slug=offering_slug,
        input_hash=input_hash,
        copy_label=copy_label,
    )
    offering = _PAID_OFFERING_SEALED.first(
        slug=offering_slug, quote=quote_id, payer=payer.lower(), duplicate_key=key, now=now
    )
    if offering is None:
        raise DomainError(ErrorCode.OFFERING_NOT_FOUND, f"No offering named {offering_slug!r}.")
    if not network_is_settled(offering.network):
        raise DomainError(ErrorCode.OFFERING_NOT_FOUND, _NOT_X402)
    return X402PaidRoute(
        offering,
        offering.quote_input_hash,  # type: ignore[attr-defined]
        offering.duplicate_id,  # type: ignore[attr-defined]
        offering.payer_owner_id,  # type: ignore[attr-defined]
    )


def _route(offering: Offering) -> X402Route:
    try:
        return X402Route(offering, network_config(offering.network))
    except UnknownNetwork as exc:
        raise DomainError(ErrorCode.OFFERING_NOT_FOUND, _NOT_X402) from exc


def _quote_anonymous_written(quote: Quote, offering: Offering) -> None:
    """An anonymous quote of an offering with stock is still written (docs/x402.md), holding
    no stock: free 402s can never drain stock."""
    with transaction.atomic():
        quote.save()
        event_record(
            subject="quote",
            quote=quote,
            actor=Actor.agent("anonymous"),
            to_state=quote.state,
            evidence={"offering": offering.slug, "anonymous": True},
        )


def x402_offer(
    *,
    offering_slug: str,
    raw_input: Any,
    buyer: Buyer | None,
    resource_url: str,
    now: datetime | None = None,
    error: str | None = None,
    sign_in: bool = True,
) -> X402Offer:
    """No payment yet: the offer naming the quote it created (or reopened), with a fresh
    sign-in challenge for this input unless `sign_in` is False (a door that takes no
    proofs: MCP). `error`: the PaymentRequired's `error` (why a sign-in was refused).

    Raises DomainError: offering_not_found, invalid_input, sold_out, not_authenticated (a
    top-up without an API key).
    """
    now = now_or(now)
    route = x402_route(offering_slug=offering_slug)
    top_up_require_buyer(offering=route.offering, has_buyer=buyer is not None)
    signed_quote: tuple[tuple[str, int | str], ...] = ()
    if buyer is not None:
        quote = quote_create(
            buyer=buyer, offering_slug=offering_slug, raw_input=raw_input, now=now
        ).quote
    else:
        canonical = quote_input_canonicalize(offering=route.offering, raw_input=raw_input)
        quote = quote_unwritten(offering=route.offering, canonical_input=canonical, now=now)
        if route.offering.stock is None:
            # Nothing written: the 402 carries the quote's terms signed, and the payment
            # brings its input back (purchases.services.x402.quote_seal); the quote is
            # written with the purchase.
            signed_quote = quote_seal(quote=quote, offering=route.offering)
        else:
            _quote_anonymous_written(quote, route.offering)
    challenge = (
        x402_sign_in_declaration(
            offering=route.offering,
            input_hash=quote.input_hash,
            resource_url=resource_url,
            now=now,
        )
        if sign_in
        else {}
    )
    requirements = x402_requirements(quote=quote)
    if signed_quote:
        requirements = replace(requirements, signed_quote=signed_quote)
    header, document = payment_required_header(
        requirements=requirements,
        network=route.network,
        resource_url=resource_url,
        description=route.offering.title,
        error=error,
        extensions={**_bazaar_for_402(route.offering), **challenge},
    )
    return X402Offer(header, document, quote.public_id)


def sign_in_binding(*, offering: Offering, input_hash: str) -> str:
    """What a sign-in challenge is issued for: this offering, this canonical input."""
    return f"{offering.slug}|{input_hash}"


def x402_sign_in_declaration(
    *, offering: Offering, input_hash: str, resource_url: str, now: datetime
) -> dict[str, Any]:
    """A quoted 402's sign-in-with-x entry (purchases.services.x402.sign_in): a challenge
    for this input at this URL; empty when sign-in is switched off."""
    ttl = settings.X402_SIGN_IN_TTL_SECONDS
    if ttl <= 0:
        return {}
    challenge = SignInChallenge(
        domain=urlsplit(resource_url).netloc,
        uri=resource_url,
        chain_id=offering.network,
        issued_at=now,
        expires_at=now + timedelta(seconds=ttl),
    )
    binding = sign_in_binding(offering=offering, input_hash=input_hash)
    return sign_in_declaration(challenge=challenge, binding=binding)


def x402_offer_price_only(
    *, offering_slug: str, resource_url: str, input_errors: list[Any] | None = None
) -> X402Offer:
    """The offer without a quote: what it costs and what input it takes. Writes nothing.

    Raises DomainError: offering_not_found.
    """
    route = x402_route(offering_slug=offering_slug)
    header, document = payment_required_header(
        requirements=x402_requirements_for_offering(offering=route.offering),
        network=route.network,
        resource_url=resource_url,
        description=route.offering.title,
        extensions=_bazaar_for_402(route.offering),
    )
    return X402Offer(header, document, None, offering_input_schema(route.offering), input_errors)


def x402_offer_from_query(
    *,
    offering_slug: str,
    params: Mapping[str, str],
    buyer: Buyer | None,
    resource_url: str,
    now: datetime | None = None,
    error: str | None = None,
) -> X402Offer:
    """An unpaid GET: a quoted offer when the query string is a valid input, else price-only.
    A top-up's invalid amount is refused instead (422): its price is the amount, so a
    price-only offer would ask a paying client for an amount nobody chose.

    Raises DomainError: offering_not_found, sold_out; for a top-up invalid_input and
    not_authenticated.
    """
    route = x402_route(offering_slug=offering_slug)
    raw_input = input_from_query(route.offering, params)
    try:
        quote_input_canonicalize(offering=route.offering, raw_input=raw_input)
    except DomainError as invalid:
        if offering_is_top_up(route.offering):
            raise
        return x402_offer_price_only(
            offering_slug=offering_slug,
            resource_url=resource_url,
            input_errors=invalid.extra.get("errors") or [invalid.detail],
        )
    return x402_offer(
        offering_slug=offering_slug,
        raw_input=raw_input,
        buyer=buyer,
        resource_url=resource_url,
        now=now,
        error=error,
    )


def input_from_query(offering: Offering, params: Mapping[str, str]) -> dict[str, Any]:
    """Query values are strings; read integers and booleans where the schema declares them.

    Anything the schema does not type as a scalar stays a string and fails validation, so
    nested inputs can only be bought with a JSON body.
    """
    properties = offering_input_schema(offering).get("properties") or {}
    result: dict[str, Any] = {}
    for name, value in params.items():
        declared = (properties.get(name) or {}).get("type")
        if declared == "integer" and value.lstrip("-").isdigit() and len(value) <= 30:
            result[name] = int(value)
        elif declared == "boolean" and value in ("true", "false"):
            result[name] = value == "true"
        else:
            result[name] = value
    return result


def _bazaar(offering: Offering) -> dict[str, Any]:
    """The bazaar description of buying `offering` (POST its input as JSON, with an example
    input), as every 402 and every discovery item declares it."""
    return {BAZAAR_KEY: bazaar_declaration(input_schema=offering_input_schema(offering))}


def _bazaar_for_402(offering: Offering) -> dict[str, Any]:
    """The 402's bazaar description, unless it is too large to travel: clients echo the
    402's extensions in PAYMENT-SIGNATURE, whose size is bounded (payments.rails.x402.wire), so a
    huge input schema would make every payment malformed. Discovery lists it regardless."""
    described = _bazaar(offering)
    if len(canonical_json(described)) > BAZAAR_402_MAX_CHARS:
        return {}
    return described


def _is_flat(schema: dict[str, Any]) -> bool:
    """Every property can be read from a query string (input_from_query)."""
    properties = schema.get("properties") or {}
    return all(_is_query_scalar(p or {}) for p in properties.values())


def _is_query_scalar(prop: dict[str, Any]) -> bool:
    if "type" in prop:
        return prop["type"] in _QUERY_SCALARS
    # An untyped enum (or const) of strings is read as a string.
    values = prop.get("enum", [prop["const"]] if "const" in prop else None)
    return isinstance(values, list) and all(isinstance(v, str) for v in values)


def _discovery_item(offering: Offering, network: NetworkConfig, base_url: str) -> dict[str, Any]:
    """One paid URL as the bazaar lists it (x402.extensions.bazaar's DiscoveryResource):
    `resource`, `type`, `x402Version`, `accepts`, `description`, `mimeType` and the bazaar
    extension; our own facts under `metadata`."""
    schema = offering_input_schema(offering)
    requirements = x402_requirements_for_offering(offering=offering)
    metadata: dict[str, Any] = {
        "title": offering.title,
        "inputSchema": schema,
        "duplicateWindowSeconds": int(offering.duplicate_window.total_seconds()),
        "expectedRunTimeSeconds": int(offering.expected_run_time.total_seconds()),
    }
    if getattr(offering, "passes_request", False):
        # An existing API sold as it is: any path below the URL (docs/upstreams.md).
        metadata["passesRequest"] = {
            "pathPrefix": f"{base_url}/x402/{offering.slug}/",
            "methods": list(PASSED_METHODS),
        }
    elif _is_flat(schema):
        # Flat inputs are bought by GET too: the same example as query parameters.
        metadata["get"] = {"method": "GET", "queryParams": input_example(schema)}
    return {
        "resource": f"{base_url}/x402/{offering.slug}",
        "type": "http",
        "x402Version": 2,
        "accepts": [
            requirements_wire(requirements, network).model_dump(
                mode="json", by_alias=True, exclude_none=True
            )
        ],
        "description": offering.description or offering.title,
        "mimeType": "application/json",
        "extensions": _bazaar(offering),
        "metadata": metadata,
    }


def x402_catalog(*, base_url: str) -> dict[str, Any]:
    """Every offering sold over x402, each as a bazaar discovery item (discovery)."""
    items = []
    passes = Upstream.objects.filter(
        offering_id=OuterRef("pk"), input_mode=Upstream.InputMode.REQUEST
    )
    offerings = Offering.objects.filter(is_active=True).annotate(passes_request=Exists(passes))
    for offering in offerings.order_by("slug"):
        try:
            network = network_config(offering.network)
        except UnknownNetwork:
            continue
        items.append(_discovery_item(offering, network, base_url))
    # The same offerings as MCP tools (doors.mcp): bazaar MCP items of their own.
    listed = [*items, *mcp_discovery_items(base_url=base_url)]
    return {
        "version": 1,
        "resources": [item["resource"] for item in items],
        "instructions": (
            "POST the offering's input as JSON (or GET with query parameters for flat inputs), "
            "answer the 402 with PAYMENT-SIGNATURE. A re-signed retry inside the duplicate "
            "window is answered with the existing purchase, never charged; send "
            "Tollbooth-Copy: <label> to buy the same input again on purpose."
        ),
        "x402Version": 2,
        "items": listed,
        "pagination": {"limit": len(listed), "offset": 0, "total": len(listed)},
    }
