"""A prepaid MCP tool call: quote, pay from the balance and, in the same round trip, the
result or where the purchase stands (the x402 outcome, as the paid URL answers it).

The x402-paid tool call needs nothing of its own: it is purchases.services.x402.checkout's
x402_pay with the MCP channel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.errors import DomainError
from purchases.models import Buyer, Purchase
from purchases.services.checkout.checkout import CheckoutAnswers
from purchases.services.checkout.idempotency import StoredAnswer
from purchases.services.checkout.prepaid_checkout import purchase_buy_prepaid
from purchases.services.quote.quotes import offering_get_active
from purchases.services.quote.top_ups import offering_is_top_up
from purchases.services.x402.outcomes import (
    X402Outcome,
    x402_outcome_for_ref,
    x402_request_scope,
)


@dataclass(frozen=True)
class PrepaidToolOutcome:
    """`stored`: the payment's answer (a refusal when >= 300); `outcome`: for a paid
    purchase, its result or why it is still pending."""

    stored: StoredAnswer
    outcome: X402Outcome | None


def tool_buy_prepaid(
    *,
    buyer: Buyer,
    offering_slug: str,
    raw_input: Any,
    payment_id: str | None,
    answers: CheckoutAnswers[tuple[StoredAnswer, bool]],
    copy_label: str | None = None,
) -> PrepaidToolOutcome:
    """Buy `offering_slug` for `raw_input` from the buyer's balance, at most once.

    Raises DomainError: what purchase_buy_prepaid raises (offering_not_found, invalid_input,
    sold_out, payment_in_flight, payment_identifier_conflict...).
    """
    offering = offering_get_active(slug=offering_slug)
    # Fast work runs in this call, as on the x402 paid URL: the tool answers with the result.
    with x402_request_scope(offering=offering):
        stored, _ = purchase_buy_prepaid(
            buyer=buyer,
            offering_slug=offering_slug,
            raw_input=raw_input,
            payment_id=payment_id,
            answers=answers,
            copy_label=copy_label,
            channel=Purchase.Channel.MCP,
        )
        if stored.status >= 300 or not stored.purchase_ref:
            return PrepaidToolOutcome(stored, None)
        return PrepaidToolOutcome(stored, x402_outcome_for_ref(ref=stored.purchase_ref))


def tool_is_top_up(*, name: str) -> bool:
    """Whether the tool tops up a balance: an API key on the connection then names the
    balance credited (the call is paid over x402), never the balance that pays."""
    try:
        return offering_is_top_up(offering_get_active(slug=name))
    except DomainError:
        return False  # no such tool: the call's own path says so
