"""The x402 paid URL's payment: a PAYMENT-SIGNATURE for an offering, answered (by the
answers the API passes in, doors.x402.answers) with the result, pending, or the
failure.

Every payment is keyed: by the client's payment id when it sends one, otherwise by what its
signature makes unique, `(network, payer, EIP-3009 nonce)` (payments.rails.x402.rail). A client's
id binds to the request normalized (x402 docs PR #2307): the offering, the quote's canonical
input, API key and copy label, and what the authorization pays (scheme, network, asset,
recipient, amount), never the signature itself. Clients that use ids re-sign on retry and
keep the id: that retry is the same request, answered with its purchase and never charged.
The orchestration is purchases.services.checkout.checkout; this module says only how x402
clients are asked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

from core.canonical import canonical_json, fingerprint, sha256_hex, strip_volatile
from core.clock import now_or
from core.errors import DomainError, ErrorCode
from payments.rails import Presentation
from payments.rails.x402.rail import AUTHORIZATION_KEY_PREFIX, x402_paid_terms, x402_presentation
from purchases.models import Buyer, Offering, Purchase
from purchases.services.checkout.checkout import (
    CheckoutAnswers,
    PaymentRequest,
    QuoteToPay,
)
from purchases.services.checkout.duplicates import copy_label_validate
from purchases.services.checkout.flow import PaymentPending, purchase_pay
from purchases.services.quote.quotes import quote_input_canonicalize
from purchases.services.x402.offers import X402PaidRoute, x402_route_paid, x402_route_paid_sealed
from purchases.services.x402.outcomes import (
    x402_request_scope,
    x402_settlement_wait_until,
    x402_wait_budget,
)
from purchases.services.x402.quote_seal import quote_from_seal, quote_seal_check, quote_seal_read

A = TypeVar("A")

X402_SCOPE = "x402"


def x402_key_scope(*, offering: Offering) -> str:
    """A paid URL's own key space: a payment id, or the (network, payer, nonce) key of a
    payment sent without one, answers only at the offering it was used at, so whoever sees
    a payment header cannot burn it by sending it first where it is refused."""
    return f"{X402_SCOPE}:{offering.pk}"


# Answered fresh every time; never stored as the payment id's answer.
UNSTORED_CODES = frozenset(
    {
        ErrorCode.PAYMENT_IN_FLIGHT,
        ErrorCode.PAYMENT_IDENTIFIER_CONFLICT,
        ErrorCode.VERIFICATION_UNAVAILABLE,
        # The seller's facilitator key refused: fixed by the seller, then the retry pays.
        ErrorCode.FACILITATOR_CREDENTIALS_REFUSED,
        ErrorCode.SETTLEMENT_UNAVAILABLE,
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
    carried_input: Callable[[Offering], Any] | None = None,
    now: datetime | None = None,
    returns_wait: bool = False,
) -> A | PaymentPending[A]:
    """Take a PAYMENT-SIGNATURE under the payment-id rules and settle it at most once.

    `raw_input`: the input a door carries beside the payment (an MCP call's arguments); it
    must be the input of the quote the payment names. None: the quote's input is the input
    (the paid URL ignores its body once paid) unless the quote is an unwritten one whose
    terms the payment carries signed (purchases.services.x402.quote_seal): then
    `carried_input`, given the offering, reads the input the request carries (the paid URL's
    body or query string), which must be the quoted one.
    Raises DomainError (never stored): payment_signature_malformed, payment_identifier_invalid,
    copy_label_invalid, invalid_payload, quote_terms_invalid (malformed signed terms),
    invalid_input, input_too_large, input_mismatch,
    payment_in_flight, payment_identifier_conflict, verification_unavailable,
    settlement_unavailable, authorization_in_use. Every other outcome is returned as
    `answers` render it, and stored or live. `returns_wait`: the door sleeps through a
    wait for the money itself (PaymentPending, purchases.services.checkout.flow).
    """
    label = copy_label_validate(label=copy_label)
    presentation = x402_presentation(header=payment_header)
    now = now_or(now)
    sealed = quote_seal_read(accepted=presentation.accepted)
    unwritten: QuoteToPay | None = None
    refusal: DomainError | None = None
    # The paid URL names the offering: only its quotes can be paid there.
    if sealed is None:
        route = x402_route_paid(offering_slug=offering_slug, quote_id=presentation.quote_id)
    else:
        route = x402_route_paid_sealed(
            offering_slug=offering_slug,
            quote_id=sealed.quote_ref,
            payer=presentation.payer,
            buyer_ref=buyer.ref if buyer else None,
            input_hash=sealed.input_hash,
            copy_label=label,
            now=now,
        )
        refusal = quote_seal_check(sealed=sealed, offering=route.offering)
        if refusal is None and route.quote_input_hash is None:
            # Not written yet (the usual case): written with the purchase, from the signed
            # terms and the input this request carries, which must be the quoted one.
            carried = raw_input if raw_input is not None else _carried(carried_input, route)
            unwritten = QuoteToPay(
                quote_from_seal(sealed=sealed, offering=route.offering, raw_input=carried),
                route.duplicate_id,
                route.payer_owner_id,
            )
            route = replace(route, quote_input_hash=sealed.input_hash)
    offering = route.offering
    # One wait budget for the settlement and the work, from here (x402_wait_budget).
    wait_until = x402_wait_budget(offering=offering)
    if raw_input is not None and unwritten is None and refusal is None:
        _input_matches_quote(route, raw_input)
    request = PaymentRequest(
        presentation=presentation,
        scope=x402_key_scope(offering=offering),
        buyer=buyer,
        copy_label=label,
        offering=offering,
        now=now,
        unstored=UNSTORED_CODES,
        fingerprint=_request_fingerprint(presentation, route, buyer, label),
        channel=channel,
        quote=unwritten,
        quote_refusal=refusal,
        settle_wait_until=x402_settlement_wait_until(wait_until=wait_until),
        # The paying request runs fast work itself: its execution job goes to a worker
        # only if the request leaves it to one. Entered again, with the same budget, after
        # a wait the door slept through (the work waits for what the settlement left).
        runs_in=lambda: x402_request_scope(offering=offering, wait_until=wait_until),
    )
    return purchase_pay(request=request, answers=answers, returns_wait=returns_wait)


def _carried(carried_input: Callable[[Offering], Any] | None, route: X402PaidRoute) -> Any:
    return carried_input(route.offering) if carried_input is not None else None


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
