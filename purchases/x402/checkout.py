"""The x402 paid URL's payment: a PAYMENT-SIGNATURE for an offering, answered (by the
answers the API passes in, purchases.x402.answers) with the result, pending, or the
failure.

Every payment is keyed: by the client's payment id when it sends one, otherwise by what its
signature makes unique, `(network, payer, EIP-3009 nonce)` (payments.x402.rail). A client's
id binds to the request normalized (x402 docs PR #2307): the offering, the quote's canonical
input, API key and copy label, and what the authorization pays (scheme, network, asset,
recipient, amount), never the signature itself. Clients that use ids re-sign on retry and
keep the id: that retry is the same request, answered with its purchase and never charged.
The orchestration is purchases.services.checkout; this module says only how x402 clients are
asked.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from core.canonical import canonical_json, fingerprint, sha256_hex, strip_volatile
from core.clock import now_or
from core.errors import DomainError, ErrorCode
from core.handoff import Handoff
from payments.rails import Presentation
from payments.x402.rail import AUTHORIZATION_KEY_PREFIX, x402_paid_terms, x402_presentation
from purchases.models import Buyer, Offering, Purchase
from purchases.services.checkout import CheckoutAnswers, PaymentRequest, purchase_pay
from purchases.services.duplicates import copy_label_validate
from purchases.services.quotes import quote_input_canonicalize
from purchases.x402.offers import X402PaidRoute, x402_route_paid
from purchases.x402.outcomes import x402_request_scope

A = TypeVar("A")

X402_SCOPE = "x402"
# Answered fresh every time; never stored as the payment id's answer.
UNSTORED_CODES = frozenset(
    {
        ErrorCode.PAYMENT_IN_FLIGHT,
        ErrorCode.PAYMENT_IDENTIFIER_CONFLICT,
        ErrorCode.VERIFICATION_UNAVAILABLE,
        ErrorCode.AUTHORIZATION_IN_USE,
    }
)


def x402_pay(
    *,
    offering_slug: str,
    payment_header: str,
    buyer: Buyer | None,
    answers: CheckoutAnswers[A],
    copy_label: str | None = None,
    channel: str = Purchase.Channel.HTTP,
    raw_input: Any = None,
    now: datetime | None = None,
) -> A:
    """Take a PAYMENT-SIGNATURE under the payment-id rules and settle it at most once.

    `raw_input`: the input a door carries beside the payment (an MCP call's arguments); it
    must be the input of the quote the payment names. None: the quote's input is the input
    (the paid URL ignores its body once paid).
    Raises DomainError (never stored): payment_signature_malformed, payment_identifier_invalid,
    copy_label_invalid, invalid_payload, invalid_input, input_too_large, input_mismatch,
    payment_in_flight, payment_identifier_conflict, verification_unavailable,
    authorization_in_use. Every other outcome is returned as `answers` render it, and stored
    or live.
    """
    label = copy_label_validate(label=copy_label)
    presentation = x402_presentation(header=payment_header)
    # The paid URL names the offering: only its quotes can be paid there.
    route = x402_route_paid(offering_slug=offering_slug, quote_id=presentation.quote_id)
    offering = route.offering
    if raw_input is not None:
        _input_matches_quote(route, raw_input)
    request = PaymentRequest(
        presentation=presentation,
        scope=X402_SCOPE,
        buyer=buyer,
        copy_label=label,
        offering=offering,
        now=now_or(now),
        unstored=UNSTORED_CODES,
        fingerprint=_request_fingerprint(presentation, route, buyer, label),
        channel=channel,
    )
    # The paying request runs fast work itself: its execution job goes to a worker only if
    # the request leaves it to one.
    try:
        with x402_request_scope(offering=offering):
            return purchase_pay(request=request, answers=answers)
    except Handoff as handoff:
        # The settlement's wait went to the caller's event loop: what follows it (the
        # recording, the work, the answer) runs in the same scope, entered again.
        raise handoff.around(lambda rest: _in_scope(offering, rest)) from None


def _in_scope(offering: Offering, rest: Callable[[], A]) -> A:
    with x402_request_scope(offering=offering):
        return rest()


def _input_matches_quote(route: X402PaidRoute, raw_input: Any) -> None:
    """The door's own input, the quote's, before the key or the chain is touched: nothing
    is recorded for a call that asks for one thing and pays for another.

    Raises DomainError: invalid_input, input_too_large, input_mismatch.
    """
    quoted = route.quote_input_hash
    if quoted is not None and isinstance(raw_input, dict):
        volatile = list(route.offering.volatile_fields or [])
        if sha256_hex(canonical_json(strip_volatile(raw_input, volatile))) == quoted:
            return  # the quote's input, validated when it was quoted (under its terms)
    # Not the quote's: say first what is wrong with the input itself, if anything.
    quote_input_canonicalize(offering=route.offering, raw_input=raw_input)
    # No quote of this offering: quote_not_found is the flow's answer, stored under the key.
    if quoted is not None:
        raise DomainError(
            ErrorCode.INPUT_MISMATCH,
            "The arguments are not the input of the quote this payment names: call the tool "
            "without payment for the offer of these arguments, and pay that.",
        )


def _request_fingerprint(
    presentation: Presentation, route: X402PaidRoute, buyer: Buyer | None, label: str
) -> str:
    """What a client's payment id binds to: the same payer (the key's principal) asking for
    the same thing, paid on the same terms, whatever authorization carries it. A payment
    keyed by its authorization keeps the payload's own fingerprint: its key is the nonce."""
    if presentation.key.startswith(AUTHORIZATION_KEY_PREFIX):
        return presentation.fingerprint
    return fingerprint(
        {
            "offering": route.offering.pk,
            # A quote of another offering, or none: the quote id stands in (refused later).
            "input": route.quote_input_hash or f"quote:{presentation.quote_id}",
            "buyer": buyer.ref if buyer else None,
            "copy": label,
            "pays": x402_paid_terms(presentation=presentation),
        }
    )
