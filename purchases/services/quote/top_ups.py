"""Top-ups over x402: what a top-up offering takes (an amount, inside the seller's limits)
and what it costs (that amount). docs/x402.md#top-ups.

A top-up is a purchase of an offering whose executor is `top_up`: its quote's price is the
amount asked for, so one quote per amount, fixed before the 402 (x402 pays exactly what a
402 offers). Only an API key's buyer opens one: the answer shows the balance it credited.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from core.errors import DomainError, ErrorCode
from fulfillment.executors.top_up import TOP_UP_EXECUTOR
from purchases.models import Offering

_NEEDS_KEY = (
    "A top-up credits the balance of the API key that asks for it: send "
    "'Authorization: Bearer <api key>' with the request."
)


def offering_is_top_up(offering: Offering) -> bool:
    return offering.executor == TOP_UP_EXECUTOR


def top_up_limits() -> tuple[int, int]:
    """The smallest and largest top-up, in the asset's atomic units (settings)."""
    return int(settings.TOLLBOOTH["TOP_UP_MIN"]), int(settings.TOLLBOOTH["TOP_UP_MAX"])


def top_up_input_schema() -> dict[str, Any]:
    """The input every top-up offering takes, whatever its own `input_schema` says."""
    low, high = top_up_limits()
    return {
        "type": "object",
        "properties": {
            "amount": {
                "type": "integer",
                "minimum": low,
                "maximum": high,
                "description": "Atomic units of the asset to credit (USDC: 1000000 = 1.00); "
                "the 402 asks for exactly this.",
            }
        },
        "required": ["amount"],
        "additionalProperties": False,
        "examples": [{"amount": low}],
    }


def offering_input_schema(offering: Offering) -> dict[str, Any]:
    """The input schema buyers are shown for `offering`."""
    if offering_is_top_up(offering):
        return top_up_input_schema()
    return offering.input_schema or {}


def top_up_input_canonicalize(*, raw_input: Any) -> dict[str, Any]:
    """{"amount": <int>} from a JSON body or a query string (digits). Raises DomainError:
    invalid_input (not an object, another field, not a whole number of atomic units, or
    outside the limits), each with what was wrong."""
    if not isinstance(raw_input, dict):
        raise DomainError(ErrorCode.INVALID_INPUT, "The input must be a JSON object.")
    low, high = top_up_limits()
    extra = {"minimum": str(low), "maximum": str(high)}
    if set(raw_input) != {"amount"}:
        raise DomainError(ErrorCode.INVALID_INPUT, "A top-up takes one field: amount.", extra=extra)
    amount = raw_input["amount"]
    # Digits only: never a float (money), a sign or an exponent. 30 digits bounds the parse.
    if isinstance(amount, str) and amount.isascii() and amount.isdigit() and len(amount) <= 30:
        amount = int(amount)
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise DomainError(
            ErrorCode.INVALID_INPUT,
            "amount is a whole number of the asset's atomic units (USDC: 1000000 = 1.00).",
            extra=extra,
        )
    if not low <= amount <= high:
        raise DomainError(
            ErrorCode.INVALID_INPUT,
            f"amount must be between {low} and {high} atomic units.",
            extra=extra,
        )
    return {"amount": amount}


def top_up_price(*, offering: Offering, canonical_input: dict[str, Any]) -> int:
    """What a quote for this input costs: the amount, for a top-up; else the offering's price."""
    if offering_is_top_up(offering):
        return int(canonical_input["amount"])
    return offering.price


def top_up_require_buyer(*, offering: Offering, has_buyer: bool) -> None:
    """Raises DomainError: not_authenticated for a top-up asked for without an API key (the
    answer names the credited balance: nobody reads another's)."""
    if offering_is_top_up(offering) and not has_buyer:
        raise DomainError(ErrorCode.NOT_AUTHENTICATED, _NEEDS_KEY)
