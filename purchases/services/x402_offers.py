"""What an x402 buyer is offered before paying (answered 402 by purchases.api.x402_answers),
and the catalogue of paid URLs.

An offer for a given input names the quote it opened (`accepts[].extra.quote`). An offer
without usable input (a bare GET, any HEAD) is price-only: the requirements without a quote,
so tools that only read offers can grade the URL, and nothing is written for it.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction

from core.actors import Actor
from core.canonical import canonical_json, sha256_hex
from core.clock import now_or
from core.errors import DomainError, ErrorCode
from payments.x402.networks import UnknownNetwork, network_config
from payments.x402.types import NetworkConfig
from payments.x402.wire import payment_required_header, requirements_wire
from purchases.events import event_record
from purchases.models import Buyer, Offering, Quote
from purchases.services.mcp_offers import mcp_discovery_items
from purchases.services.quotes import offering_get_active, quote_create, quote_input_canonicalize
from purchases.services.x402_outcomes import x402_requirements, x402_requirements_for_offering

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


def x402_route(*, offering_slug: str) -> X402Route:
    """Raises DomainError: offering_not_found (also for an offering on no x402 network)."""
    offering = offering_get_active(slug=offering_slug)
    try:
        return X402Route(offering, network_config(offering.network))
    except UnknownNetwork as exc:
        raise DomainError(
            ErrorCode.OFFERING_NOT_FOUND, "This offering is not sold over x402."
        ) from exc


def _quote_anonymous(offering: Offering, raw_input: Any, now: datetime) -> Quote:
    """A fresh short-lived quote that holds no stock: free 402s can never drain stock."""
    canonical = quote_input_canonicalize(offering=offering, raw_input=raw_input)
    with transaction.atomic():
        quote = Quote.objects.create(
            offering=offering,
            buyer=None,
            quote_key=sha256_hex(secrets.token_hex(16)),
            canonical_input=canonical,
            input_hash=sha256_hex(canonical_json(canonical)),
            price=offering.price,
            asset=offering.asset,
            network=offering.network,
            pay_to=offering.pay_to,
            offering_version=offering.version,
            holds_stock=False,
            expires_at=now + timedelta(seconds=settings.X402_ANONYMOUS_QUOTE_TTL_SECONDS),
        )
        event_record(
            subject="quote",
            quote=quote,
            actor=Actor.agent("anonymous"),
            to_state=quote.state,
            evidence={"offering": offering.slug, "anonymous": True},
        )
    return quote


def x402_offer(
    *,
    offering_slug: str,
    raw_input: Any,
    buyer: Buyer | None,
    resource_url: str,
    now: datetime | None = None,
) -> X402Offer:
    """No payment yet: the offer naming the quote it created (or reopened).

    Raises DomainError: offering_not_found, invalid_input, sold_out.
    """
    now = now_or(now)
    route = x402_route(offering_slug=offering_slug)
    if buyer is not None:
        quote = quote_create(
            buyer=buyer, offering_slug=offering_slug, raw_input=raw_input, now=now
        ).quote
    else:
        quote = _quote_anonymous(route.offering, raw_input, now)
    header, document = payment_required_header(
        requirements=x402_requirements(quote=quote),
        network=route.network,
        resource_url=resource_url,
        description=route.offering.title,
    )
    return X402Offer(header, document, quote.public_id)


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
    )
    return X402Offer(header, document, None, route.offering.input_schema, input_errors)


def x402_offer_from_query(
    *,
    offering_slug: str,
    params: Mapping[str, str],
    buyer: Buyer | None,
    resource_url: str,
    now: datetime | None = None,
) -> X402Offer:
    """An unpaid GET: a quoted offer when the query string is a valid input, else price-only.

    Raises DomainError: offering_not_found, sold_out.
    """
    route = x402_route(offering_slug=offering_slug)
    raw_input = _input_from_query(route.offering, params)
    try:
        quote_input_canonicalize(offering=route.offering, raw_input=raw_input)
    except DomainError as invalid:
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
    )


def _input_from_query(offering: Offering, params: Mapping[str, str]) -> dict[str, Any]:
    """Query values are strings; read integers and booleans where the schema declares them.

    Anything the schema does not type as a scalar stays a string and fails validation, so
    nested inputs can only be bought with a JSON body.
    """
    properties = (offering.input_schema or {}).get("properties") or {}
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


def _http_input(offering: Offering) -> dict[str, Any]:
    schema = offering.input_schema or {}
    properties = schema.get("properties") or {}
    flat = all((p or {}).get("type") in _QUERY_SCALARS for p in properties.values())
    described: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "bodyType": "json",
        "bodyFields": schema,
    }
    if flat:
        described["queryParams"] = schema
    return described


def x402_catalog(*, base_url: str) -> dict[str, Any]:
    """Every offering sold over x402 with its requirements and input schema (discovery)."""
    items = []
    for offering in Offering.objects.filter(is_active=True).order_by("slug"):
        try:
            network = network_config(offering.network)
        except UnknownNetwork:
            continue
        requirements = x402_requirements_for_offering(offering=offering)
        url = f"{base_url}/x402/{offering.slug}"
        items.append(
            {
                "resource": url,
                "type": "http",
                "x402Version": 2,
                "accepts": [
                    requirements_wire(requirements, network).model_dump(
                        mode="json", by_alias=True, exclude_none=True
                    )
                ],
                "metadata": {
                    "title": offering.title,
                    "description": offering.description,
                    "input": _http_input(offering),
                    "output": {"mimeType": "application/json"},
                    "duplicateWindowSeconds": int(offering.duplicate_window.total_seconds()),
                    "expectedRunTimeSeconds": int(offering.expected_run_time.total_seconds()),
                },
            }
        )
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
        # The same offerings as MCP tools (purchases.mcp): bazaar MCP items of their own.
        "items": items + mcp_discovery_items(base_url=base_url),
    }
