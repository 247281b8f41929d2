"""The x402 paid URL's payment: a PAYMENT-SIGNATURE for an offering, answered with the
result, a pending 202 naming the transaction and the status URL, or the failure.

Every payment is keyed: by the client's payment id when it sends one, otherwise by what its
signature makes unique, `(network, payer, EIP-3009 nonce)` (payments.rails.x402). The
orchestration is purchases.services.checkout; this module says only how x402 clients are
asked and answered.
"""

from __future__ import annotations

from datetime import datetime

from core.clock import now_or
from core.errors import ErrorCode
from payments.models import PaymentAttempt
from payments.rails.x402 import x402_presentation
from purchases.models import Buyer, Purchase
from purchases.services.checkout import PaymentRequest, purchase_pay
from purchases.services.duplicates import DUPLICATE_HEADER, copy_label_validate
from purchases.services.idempotency import StoredAnswer
from purchases.services.x402_answers import X402Answer, x402_answer_for_purchase
from purchases.services.x402_offers import x402_route

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
    copy_label: str | None = None,
    now: datetime | None = None,
) -> X402Answer:
    """Take a PAYMENT-SIGNATURE under the payment-id rules and settle it at most once.

    Raises DomainError (never stored): payment_signature_malformed, payment_identifier_invalid,
    copy_label_invalid, invalid_payload, payment_in_flight, payment_identifier_conflict,
    verification_unavailable, authorization_in_use. Every other outcome is returned, and
    stored or live.
    """
    label = copy_label_validate(label=copy_label)
    presentation = x402_presentation(header=payment_header)
    request = PaymentRequest(
        presentation=presentation,
        scope=X402_SCOPE,
        buyer=buyer,
        copy_label=label,
        offering=None,
        now=now_or(now),
        unstored=UNSTORED_CODES,
    )
    return purchase_pay(request=_for_route(request, offering_slug), answers=X402Answers())


def _for_route(request: PaymentRequest, offering_slug: str) -> PaymentRequest:
    """The paid URL names the offering: only its quotes can be paid there."""
    route = x402_route(offering_slug=offering_slug)
    return PaymentRequest(
        presentation=request.presentation,
        scope=request.scope,
        buyer=request.buyer,
        copy_label=request.copy_label,
        offering=route.offering,
        now=request.now,
        unstored=request.unstored,
    )


class X402Answers:
    """A settled payment is answered live (from the purchase as it is at each replay); a
    failed one is stored byte for byte."""

    def recorded(self, *, purchase: Purchase, attempt: PaymentAttempt) -> StoredAnswer:
        return StoredAnswer(200, None, {}, purchase.ref, is_live=True)

    def settled(
        self, *, purchase: Purchase, attempt: PaymentAttempt | None, fresh: bool
    ) -> tuple[StoredAnswer, X402Answer]:
        answer = x402_answer_for_purchase(
            purchase=purchase, reconcile=False, fresh=fresh, attempt=attempt
        )
        if purchase.payment_state != Purchase.PaymentState.FAILED:
            return StoredAnswer(answer.status, None, {}, purchase.ref, is_live=True), answer
        stored = StoredAnswer(answer.status, answer.body, answer.headers, purchase.ref)
        return stored, _as_sent(stored)

    def duplicate(self, *, purchase: Purchase) -> StoredAnswer:
        return StoredAnswer(200, None, {DUPLICATE_HEADER: purchase.ref}, purchase.ref, is_live=True)

    def render(self, stored: StoredAnswer, is_replay: bool) -> X402Answer:
        if stored.is_live and stored.purchase_ref:
            purchase = Purchase.objects.select_related("offering").get(ref=stored.purchase_ref)
            answer = x402_answer_for_purchase(purchase=purchase, reconcile=True)
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
    return X402Answer(stored.status, stored.raw or b"", headers, content_type=content_type)
