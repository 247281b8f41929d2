"""What an x402 client is answered: the 402 offer, and for a purchase its result, a pending
202 with the status URL, or the failure (from purchases.services.x402.outcomes). The paid
URL, a resent payment and the capability URL all answer from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings

from core.clock import now_or
from core.errors import PROBLEM_HEADERS, DomainError, ErrorCode
from doors.rest.answers import (
    DUPLICATE_HEADER,
    receipt_headers,
    receipt_headers_of,
    recorded_answer,
    refusal_answer,
    sent_bytes,
)
from payments.models import PaymentAttempt, Rail
from payments.rails.x402.wire import payment_response_header
from purchases.models import Buyer, Purchase
from purchases.selectors import purchase_capability_url, purchase_status
from purchases.services.checkout.idempotency import StoredAnswer
from purchases.services.x402.offers import X402Offer, x402_offer, x402_offer_from_query
from purchases.services.x402.outcomes import (
    PaymentFailed,
    ResultDelivered,
    ResultRefused,
    SettlementPending,
    WorkPending,
    X402Outcome,
    x402_outcome_for_capability,
    x402_outcome_for_purchase,
    x402_outcome_for_ref,
)
from purchases.services.x402.sign_in import SignInRefused, x402_sign_in

PAY = Purchase.PaymentState
PAYMENT_REQUIRED = "PAYMENT-REQUIRED"
PAYMENT_RESPONSE = "PAYMENT-RESPONSE"
_INPUT_ERRORS = (ErrorCode.INVALID_INPUT, ErrorCode.INPUT_TOO_LARGE)
SEND_INPUT = "Send the input (JSON body, or query parameters for flat inputs) to get a quote."


@dataclass(frozen=True)
class X402Answer:
    status: int
    body: Any  # a JSON document, or the result's bytes
    headers: dict[str, str]
    content_type: str | None = None


def x402_offer_answer(offer: X402Offer, refused: SignInRefused | None = None) -> X402Answer:
    """No payment yet: 402 with PAYMENT-REQUIRED (naming the quote, or price-only).
    `refused`: the wallet sign-in this request tried, and why it was not honoured."""
    if offer.quote is not None:
        extra: dict[str, Any] = {"quote": offer.quote, "paymentRequired": offer.document}
        if refused is not None:
            extra["sign_in"] = {"refused": refused.reason, "detail": refused.detail}
        error = DomainError(ErrorCode.PAYMENT_REQUIRED, extra=extra)
    else:
        extra = {
            "quote": None,
            "paymentRequired": offer.document,
            "input_schema": offer.input_schema,
            **({"errors": offer.input_errors} if offer.input_errors else {}),
        }
        error = DomainError(ErrorCode.PAYMENT_REQUIRED, SEND_INPUT, extra=extra)
    headers = {PAYMENT_REQUIRED: offer.payment_required, **PROBLEM_HEADERS}
    return X402Answer(402, error.as_problem(), headers)


def x402_answer(outcome: X402Outcome) -> X402Answer:
    """What an x402 client gets for a purchase where it stands now."""
    if isinstance(outcome, PaymentFailed):
        error = outcome.error
        return X402Answer(error.spec.status, error.as_problem(), dict(PROBLEM_HEADERS))
    purchase, attempt = outcome.purchase, outcome.attempt
    if isinstance(outcome, SettlementPending):
        return _settlement_pending(purchase, attempt, outcome.created_with)
    headers = {PAYMENT_RESPONSE: _payment_response(purchase, attempt)}
    if isinstance(outcome, WorkPending):
        status_url = purchase_capability_url(purchase=purchase)
        body = {**outcome.status, "next_action": "poll_status_url", "status_url": status_url}
        retry_after = {"Retry-After": str(outcome.retry_after)}
        return X402Answer(202, body, {**headers, "Location": status_url, **retry_after})
    if isinstance(outcome, ResultRefused):
        error = outcome.error
        headers.update(receipt_headers_of(error.extra))
        return X402Answer(error.spec.status, error.as_problem(), {**headers, **PROBLEM_HEADERS})
    assert isinstance(outcome, ResultDelivered)
    delivery = outcome.delivery
    headers.update(
        {
            "Repr-Digest": f"sha-256=:{delivery.sha256_b64}:",
            "Link": f'<{delivery.receipt_url}>; rel="receipt"',
            **receipt_headers(delivery.signed_receipt),
        }
    )
    return X402Answer(200, delivery.body, headers, content_type=delivery.content_type)


def x402_sign_in_answer(
    *,
    offering_slug: str,
    header: str,
    raw_input: Any,
    buyer: Buyer | None,
    resource_url: str,
    from_query: bool = False,
) -> X402Answer:
    """A SIGN-IN-WITH-X proof: the purchase it signs in to (its result, or pending), with
    no PAYMENT-RESPONSE (nothing is paid in this exchange). A proof that is not honoured
    gets the ordinary 402 with a fresh challenge, saying why (`sign_in.refused`), so a
    client falls back to paying.

    Raises DomainError: offering_not_found, invalid_input, input_too_large, sold_out.
    """
    try:
        outcome = x402_sign_in(
            offering_slug=offering_slug,
            header=header,
            raw_input=raw_input,
            resource_url=resource_url,
            from_query=from_query,
        )
    except DomainError as invalid:
        if not from_query or invalid.code not in _INPUT_ERRORS:
            raise
        # A query string that is no input: the price-only 402, as a GET without a proof.
        return x402_offer_answer(
            _offer_again(offering_slug, raw_input, buyer, resource_url, from_query, None)
        )
    except SignInRefused as refused:
        error = f"sign-in refused: {refused.reason}"
        offer = _offer_again(offering_slug, raw_input, buyer, resource_url, from_query, error)
        return x402_offer_answer(offer, refused)
    answer = x402_answer(outcome)
    answer.headers.pop(PAYMENT_RESPONSE, None)
    return answer


def _offer_again(
    offering_slug: str,
    raw_input: Any,
    buyer: Buyer | None,
    resource_url: str,
    from_query: bool,
    error: str | None,
) -> X402Offer:
    """The 402 this request gets without its proof (by GET: from the query string)."""
    if from_query:
        return x402_offer_from_query(
            offering_slug=offering_slug,
            params=raw_input,
            buyer=buyer,
            resource_url=resource_url,
            error=error,
        )
    return x402_offer(
        offering_slug=offering_slug,
        raw_input=raw_input,
        buyer=buyer,
        resource_url=resource_url,
        error=error,
    )


def _payment_response(purchase: Purchase, attempt: PaymentAttempt | None) -> str:
    is_settled = purchase.payment_state == PAY.PAID
    return payment_response_header(
        success=is_settled,
        transaction=attempt.tx_hash if attempt else None,
        network=purchase.network,
        payer=purchase.payer,
        error_reason=None if is_settled else "settlement_pending",
        amount=purchase.amount,
    )


def _retry_after() -> dict[str, str]:
    return {"Retry-After": str(settings.TOLLBOOTH["RETRY_AFTER_SECONDS"])}


def _settlement_pending(
    purchase: Purchase, attempt: PaymentAttempt | None, created_with: PaymentAttempt | None
) -> X402Answer:
    status_url = purchase_capability_url(purchase=purchase)
    body = {
        **purchase_status(purchase=purchase, now=now_or(None), created_with=created_with),
        "status": "settlement_pending",
        "transaction": attempt.tx_hash if attempt else None,
        # x402 agents may have no API key: the status URL, or resending the same signed
        # payment, is how they poll.
        "next_action": "poll_status_url",
        "owner": "reconciliation",
        "reason_code": (attempt.reason_code if attempt else "") or purchase.reason_code or None,
        "status_url": status_url,
    }
    headers = {
        PAYMENT_RESPONSE: _payment_response(purchase, attempt),
        "Location": status_url,
        **_retry_after(),
    }
    return X402Answer(202, body, headers)


def x402_capability_answer(*, ref: str, token: str) -> X402Answer:
    """The capability URL: the purchase's status, or its result once ready.

    Raises DomainError: purchase_not_found.
    """
    outcome = x402_outcome_for_capability(ref=ref, token=token)
    answer = x402_answer(outcome)
    if outcome.purchase.rail != Rail.X402:
        answer.headers.pop(PAYMENT_RESPONSE, None)
    return answer


class X402Answers:
    """The x402 paid URL's answers (purchases.services.checkout.checkout.CheckoutAnswers): a settled
    payment is answered live (from the purchase as it is at each replay); a failed one is
    stored byte for byte."""

    def recorded(self, *, purchase: Purchase, attempt: PaymentAttempt) -> StoredAnswer:
        return recorded_answer(200, None, {}, purchase.ref, is_live=True)

    def settled(
        self, *, purchase: Purchase, attempt: PaymentAttempt | None, fresh: bool
    ) -> tuple[StoredAnswer, X402Answer]:
        answer = x402_answer(
            x402_outcome_for_purchase(
                purchase=purchase, reconcile=False, fresh=fresh, attempt=attempt
            )
        )
        if purchase.payment_state != PAY.FAILED:
            return recorded_answer(answer.status, None, {}, purchase.ref, is_live=True), answer
        stored = recorded_answer(answer.status, answer.body, answer.headers, purchase.ref)
        return stored, _as_sent(stored)

    def duplicate(self, *, purchase: Purchase) -> StoredAnswer:
        return recorded_answer(
            200, None, {DUPLICATE_HEADER: purchase.ref}, purchase.ref, is_live=True
        )

    def refused(self, error: DomainError) -> StoredAnswer:
        return refusal_answer(error)

    def render(self, stored: StoredAnswer, is_replay: bool) -> X402Answer:
        if stored.is_live and stored.purchase_ref:
            answer = x402_answer(x402_outcome_for_ref(ref=stored.purchase_ref))
            return X402Answer(
                answer.status,
                answer.body,
                {**answer.headers, **stored.headers},
                answer.content_type,
            )
        return _as_sent(stored)


def _as_sent(stored: StoredAnswer) -> X402Answer:
    """A stored answer, byte for byte as it was first sent."""
    headers = dict(stored.headers)
    content_type = headers.pop("Content-Type", "application/json")
    return X402Answer(stored.status, sent_bytes(stored), headers, content_type=content_type)
