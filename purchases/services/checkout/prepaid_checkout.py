"""The prepaid API's payment: a quote paid from the buyer's balance under an
Idempotency-Key; the answer (doors.rest.prepaid_answers) is stored with the debit."""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypeVar

from core.canonical import fingerprint, sha256_hex
from core.clock import now_or
from core.errors import ErrorCode
from payments.models import Rail
from payments.rails import Presentation
from purchases.models import Buyer, Purchase
from purchases.services.checkout.checkout import CheckoutAnswers, PaymentRequest
from purchases.services.checkout.duplicates import copy_label_validate
from purchases.services.checkout.flow import purchase_pay
from purchases.services.checkout.idempotency import payment_id_validate
from purchases.services.quote.quotes import quote_create

A = TypeVar("A")

PREPAID_SCOPE = "prepaid"
# Outcomes about the key itself are answered fresh each time, never stored as the key's answer.
# (A key past retention is refused by its claim, before any work: nothing to leave unstored.)
UNSTORED_CODES = frozenset({ErrorCode.PAYMENT_IN_FLIGHT, ErrorCode.PAYMENT_IDENTIFIER_CONFLICT})


def purchase_pay_prepaid(
    *,
    buyer: Buyer,
    quote_id: str,
    payment_id: str | None,
    answers: CheckoutAnswers[A],
    copy_label: str | None = None,
    channel: str = Purchase.Channel.API,
    now: datetime | None = None,
) -> A:
    """Pay a quote from the buyer's balance; returns what `answers` render.

    A new key for what this buyer already bought (same offering and input, same copy label)
    inside the offering's duplicate window is answered with that purchase, as a duplicate,
    and nothing is debited.
    Raises DomainError: idempotency_key_missing, idempotency_key_invalid, copy_label_invalid,
    payment_identifier_conflict, payment_in_flight (never stored). Every other domain
    outcome (quote_not_found, quote_expired, quote_already_paid, insufficient_funds,
    spend_cap_exceeded) is stored as the key's answer and returned.
    """
    key = payment_id_validate(key=payment_id)
    label = copy_label_validate(label=copy_label)
    request = {"quote": quote_id, "rail": "prepaid", **({"copy": label} if label else {})}
    return purchase_pay(
        request=PaymentRequest(
            presentation=Presentation(
                rail=Rail.PREPAID,
                key=key,
                payer=buyer.ref,
                fingerprint=fingerprint(request),
                quote_id=quote_id,
            ),
            scope=PREPAID_SCOPE,
            buyer=buyer,
            copy_label=label,
            offering=None,
            now=now_or(now),
            unstored=UNSTORED_CODES,
            channel=channel,
        ),
        answers=answers,
    )


def purchase_buy_prepaid(
    *,
    buyer: Buyer,
    offering_slug: str,
    raw_input: Any,
    payment_id: str | None,
    answers: CheckoutAnswers[A],
    copy_label: str | None = None,
    channel: str = Purchase.Channel.MCP,
    now: datetime | None = None,
) -> A:
    """Quote and pay from the balance in one call (an MCP tool call has no quote step).

    The buyer's quote for the same canonical input is the same open quote
    (purchases.services.quote.quotes), so without a payment id the key is derived from it: the
    same call repeated while the quote is open replays the stored answer, and after it the
    duplicate window answers with the existing purchase. Nothing is debited twice either way.
    Raises DomainError: offering_not_found, invalid_input, sold_out, and everything
    purchase_pay_prepaid raises.
    """
    now = now_or(now)
    quote = quote_create(buyer=buyer, offering_slug=offering_slug, raw_input=raw_input, now=now)
    key = payment_id or f"{channel}-{sha256_hex(buyer.ref + '|' + quote.quote.public_id)[:48]}"
    return purchase_pay_prepaid(
        buyer=buyer,
        quote_id=quote.quote.public_id,
        payment_id=key,
        answers=answers,
        copy_label=copy_label,
        channel=channel,
        now=now,
    )
