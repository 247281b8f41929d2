"""What an x402 client is answered for a purchase: its result, a pending 202 with the
status URL, or the failure. The paid URL, a resent payment and the capability URL all
answer from here, from the purchase's current state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings

from core.clock import now_or
from core.errors import PROBLEM_HEADERS, DomainError, ErrorCode
from payments.models import PaymentAttempt, Rail
from payments.rails import QuoteTerms
from payments.rails.x402 import x402_requirements as requirements_for_terms
from payments.x402.attempts import x402_attempt_live
from payments.x402.networks import network_config
from payments.x402.types import Requirements
from payments.x402.wire import payment_response_header
from purchases.models import Offering, Purchase, Quote
from purchases.selectors import (
    purchase_capability_url,
    purchase_get_by_capability,
    purchase_status,
)
from purchases.services.delivery import DeliveryPending, purchase_result_deliver
from purchases.services.result_wait import purchase_await_result
from purchases.services.settlement import purchase_reload, purchase_settle_attempt, quote_terms

PAY = Purchase.PaymentState
RUN = Purchase.FulfillmentState


@dataclass(frozen=True)
class X402Answer:
    status: int
    body: Any  # a JSON document, or the result's bytes
    headers: dict[str, str]
    content_type: str | None = None


def x402_requirements(*, quote: Quote) -> Requirements:
    """What we asked for: the `accepts` entry a quote stands for on its network."""
    return requirements_for_terms(
        terms=quote_terms(quote=quote), network=network_config(quote.network)
    )


def x402_requirements_for_offering(*, offering: Offering) -> Requirements:
    """The price-only `accepts` entry (no quote): for discovery and input-less offers."""
    terms = QuoteTerms(
        quote_id="",
        network=offering.network,
        asset=offering.asset,
        amount=offering.price,
        pay_to=offering.pay_to,
        duplicate_window_seconds=int(offering.duplicate_window.total_seconds()),
    )
    return requirements_for_terms(terms=terms, network=network_config(offering.network))


def x402_answer_for_purchase(
    *,
    purchase: Purchase,
    reconcile: bool,
    fresh: bool = False,
    attempt: PaymentAttempt | None = None,
    channel: str = "x402_paid_url",
) -> X402Answer:
    """What an x402 client gets for this purchase now: the result, pending, or the failure.

    `fresh`: this request created the purchase, so while its work is pending it has no
    result, refund, escalation or receipt to read yet. `attempt`: its latest payment
    attempt, already read. `channel`: where a delivered result goes, for the timeline.
    """
    if reconcile and purchase.payment_state in (PAY.PAYING, PAY.SETTLEMENT_PENDING):
        attempt = x402_attempt_live(purchase_id=purchase.pk)
        if attempt is not None:
            purchase_settle_attempt(attempt_id=attempt.pk)
        purchase = purchase_reload(purchase=purchase)
    if attempt is None or reconcile:
        attempt = purchase.payment_attempts.order_by("-pk").first()
    if purchase.payment_state == PAY.FAILED:
        error = DomainError(
            ErrorCode.PAYMENT_FAILED,
            purchase=purchase.ref,
            extra={"reason": attempt.reason_code if attempt else purchase.reason_code},
        )
        return X402Answer(error.spec.status, error.as_problem(), dict(PROBLEM_HEADERS))
    created_with = attempt if fresh else None
    if not purchase.is_payment_sufficient_for_execution():
        return _pending_answer(purchase, attempt, created_with)
    return _delivery_answer(purchase, attempt, created_with, channel)


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


def _pending_answer(
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
        "PAYMENT-RESPONSE": _payment_response(purchase, attempt),
        "Location": status_url,
        **_retry_after(),
    }
    return X402Answer(202, body, headers)


def _await_work(purchase: Purchase) -> Purchase:
    """Give a fast job the chance to answer in this round trip: up to the offering's expected
    run time, never past the server-wide cap; then 202."""
    wait = min(
        purchase.offering.expected_run_time.total_seconds(),
        float(settings.X402_RESULT_WAIT_SECONDS),
    )
    return purchase_await_result(purchase=purchase, wait_seconds=wait)


def _delivery_answer(
    purchase: Purchase,
    attempt: PaymentAttempt | None,
    created_with: PaymentAttempt | None,
    channel: str,
) -> X402Answer:
    purchase = _await_work(purchase)
    headers = {"PAYMENT-RESPONSE": _payment_response(purchase, attempt)}
    try:
        delivery = purchase_result_deliver(
            purchase=purchase, created_with=created_with, channel=channel
        )
    except DeliveryPending as pending:
        status_url = purchase_capability_url(purchase=purchase)
        body = {**pending.status, "next_action": "poll_status_url", "status_url": status_url}
        return X402Answer(202, body, {**headers, "Location": status_url, **_retry_after()})
    except DomainError as error:
        return X402Answer(
            error.spec.status,
            error.as_problem(),
            {**headers, **PROBLEM_HEADERS},
        )
    headers.update(
        {
            "Repr-Digest": f"sha-256=:{delivery.sha256_b64}:",
            "Link": f'<{delivery.receipt_url}>; rel="receipt"',
        }
    )
    return X402Answer(200, delivery.body, headers, content_type=delivery.content_type)


def x402_answer_for_capability(*, ref: str, token: str) -> X402Answer:
    """What the capability URL shows: this purchase's status, or its result once ready.

    Reconciles a pending settlement first, exactly as a resent payment would.
    Raises DomainError: purchase_not_found (wrong token, another purchase's, or no purchase).
    """
    purchase = purchase_get_by_capability(ref=ref, token=token)
    answer = x402_answer_for_purchase(purchase=purchase, reconcile=True, channel="capability_url")
    if purchase.rail != Rail.X402:
        answer.headers.pop("PAYMENT-RESPONSE", None)
    return answer
