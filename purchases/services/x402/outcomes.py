"""Where an x402 purchase stands for its buyer: failed, settling, running, refused or
delivered. The paid URL, a resent payment and the capability URL all ask here, from the
purchase's current state; doors.x402.answers says how each is answered.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from core.clock import now_or
from core.errors import DomainError, ErrorCode
from payments.models import PaymentAttempt
from payments.rails import QuoteTerms
from payments.rails.x402.attempts import x402_attempt_live
from payments.rails.x402.finality import Finality
from payments.rails.x402.networks import network_config
from payments.rails.x402.rail import x402_requirements as requirements_for_terms
from payments.rails.x402.types import Requirements
from purchases.models import Offering, Purchase, Quote
from purchases.selectors import purchase_get_by_capability, purchase_reload
from purchases.services.fulfil.delivery import Delivery, DeliveryPending, purchase_result_deliver
from purchases.services.fulfil.result_wait import (
    purchase_await_result,
    purchase_inline_execution_scope,
)
from purchases.services.quote.quotes import offering_payment_flow, offering_payment_window
from purchases.services.settle.finality import settlement_finality_follow
from purchases.services.settle.settlement import (
    purchase_settle_attempt,
    quote_terms,
)

PAY = Purchase.PaymentState


@dataclass(frozen=True)
class PaymentFailed:
    """The payment failed: nothing runs. `error` is payment_failed, naming the reason."""

    purchase: Purchase
    error: DomainError


@dataclass(frozen=True)
class SettlementPending:
    """The money is not yet proven moved: the buyer polls, reconciliation owns it.
    `created_with`: the attempt this request created the purchase with, if it did."""

    purchase: Purchase
    attempt: PaymentAttempt | None
    created_with: PaymentAttempt | None


@dataclass(frozen=True)
class WorkPending:
    """Paid, and the work still runs or its outcome is unknown (checked again): `status` is
    the purchase's status document, `retry_after` the seconds to wait before polling."""

    purchase: Purchase
    attempt: PaymentAttempt | None
    status: dict[str, Any]
    retry_after: int


@dataclass(frozen=True)
class ResultRefused:
    """Paid, and no result to give: `error` says why (execution_failed, result_expired...)."""

    purchase: Purchase
    attempt: PaymentAttempt | None
    error: DomainError


@dataclass(frozen=True)
class ResultDelivered:
    purchase: Purchase
    attempt: PaymentAttempt | None
    delivery: Delivery


X402Outcome = PaymentFailed | SettlementPending | WorkPending | ResultRefused | ResultDelivered


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
        payment_flow=offering_payment_flow(offering=offering),
        max_timeout_seconds=offering_payment_window(offering=offering),
    )
    return requirements_for_terms(terms=terms, network=network_config(offering.network))


def x402_outcome_for_purchase(
    *,
    purchase: Purchase,
    reconcile: bool,
    fresh: bool = False,
    attempt: PaymentAttempt | None = None,
    channel: str = "x402_paid_url",
) -> X402Outcome:
    """Where this purchase stands now: its result (delivered), pending, or the failure.

    `reconcile`: settle a pending payment first. `fresh`: this request created the
    purchase, so while its work is pending it has no result, refund, escalation or receipt
    to read yet. `attempt`: its latest payment attempt, already read. `channel`: where a
    delivered result goes, for the timeline.
    """
    if reconcile and purchase.payment_state in (PAY.PAYING, PAY.SETTLEMENT_PENDING):
        attempt = x402_attempt_live(purchase_id=purchase.pk)
        if attempt is not None:
            purchase_settle_attempt(attempt_id=attempt.pk)
        purchase = purchase_reload(purchase=purchase)
    if attempt is None or reconcile:
        attempt = purchase.payment_attempts.order_by("-pk").first()
    if reconcile and _is_watched(purchase, attempt):
        # Paid, not yet final: say what the chain says now, not what it said at settlement.
        assert attempt is not None
        check = settlement_finality_follow(attempt=attempt, now=now_or(None))
        if check.finality == Finality.FINAL:  # recorded by that look: its receipt may be issued
            attempt.refresh_from_db(fields=["final_at", "block_number", "tx_hash", "block_at"])
        if check.finality == Finality.UNDONE:
            purchase = purchase_reload(purchase=purchase)
            attempt = purchase.payment_attempts.order_by("-pk").first()
    if purchase.payment_state in (PAY.FAILED, PAY.REVERSED):
        code = ErrorCode.PAYMENT_FAILED if purchase.payment_state == PAY.FAILED else None
        error = DomainError(
            code or ErrorCode.PAYMENT_REVERSED,
            purchase=purchase.ref,
            extra={"reason": attempt.reason_code if attempt else purchase.reason_code},
        )
        return PaymentFailed(purchase, error)
    if purchase.payment_state == PAY.RELEASED:
        return ResultRefused(purchase, attempt, _released_error(purchase, attempt))
    created_with = attempt if fresh else None
    if not purchase.is_payment_sufficient_for_execution():
        return SettlementPending(purchase, attempt, created_with)
    purchase = _await_work(purchase)
    try:
        delivery = purchase_result_deliver(
            purchase=purchase, created_with=created_with, channel=channel, attempt=attempt
        )
    except DeliveryPending as pending:
        return WorkPending(purchase, attempt, pending.status, pending.retry_after)
    except DomainError as error:
        return ResultRefused(purchase, attempt, error)
    return ResultDelivered(purchase, attempt, delivery)


def _released_error(purchase: Purchase, attempt: PaymentAttempt | None) -> DomainError:
    """The authorization flow's provably failed work: nothing was or will be charged."""
    lapses_at = attempt.valid_before_at if attempt is not None else None
    when = lapses_at.isoformat() if lapses_at else "its validBefore"
    return DomainError(
        ErrorCode.EXECUTION_FAILED,
        f"The work was refused ({purchase.reason_code}). We will not charge this "
        f"authorization; it lapses at {when}.",
        purchase=purchase.ref,
        extra={
            "charged": False,
            "authorization_lapses_at": lapses_at.isoformat() if lapses_at else None,
            "execution_reason": purchase.reason_code,
        },
    )


def _is_watched(purchase: Purchase, attempt: PaymentAttempt | None) -> bool:
    return (
        purchase.payment_state == PAY.PAID
        and attempt is not None
        and attempt.rail == "x402"
        and attempt.state == PaymentAttempt.State.SUCCEEDED
        and attempt.final_at is None
    )


def _await_work(purchase: Purchase) -> Purchase:
    """Give a fast job the chance to answer in this round trip; then pending. Inside an
    x402 request's scope the wait is what is left of its budget (x402_wait_budget)."""
    return purchase_await_result(purchase=purchase, wait_seconds=_work_wait_seconds(purchase))


def _result_wait_seconds(offering: Offering) -> float:
    """Up to the offering's expected run time, never past the server-wide cap."""
    return min(offering.expected_run_time.total_seconds(), float(settings.X402_RESULT_WAIT_SECONDS))


def _work_wait_seconds(purchase: Purchase) -> float:
    budget = _BUDGET.get()
    if budget is None or budget[0] != purchase.offering_id:
        return _result_wait_seconds(purchase.offering)
    return max(0.0, budget[1] - time.monotonic())


# A settlement is always given this long, whatever the budget (even 0): on a fast chain the
# block lands within it, and a 202 for a payment mined milliseconds later would cost the
# agent a poll and us a reconciliation. A budget of 0 still means no wait for the work.
SETTLEMENT_WAIT_FLOOR_SECONDS = 1.0
# (offering pk, the request's wait budget's end as time.monotonic()) inside x402_request_scope.
_BUDGET: ContextVar[tuple[int, float] | None] = ContextVar("x402_wait_budget", default=None)


def x402_wait_budget(*, offering: Offering) -> float:
    """When a paid request for `offering` starting now must stop waiting (time.monotonic()).

    One budget for the request's whole wait, its settlement and then its work: the
    offering's expected run time, capped by X402_RESULT_WAIT_SECONDS. The settlement waits
    until then at most (never past its network's confirmation_timeout, and at least
    SETTLEMENT_WAIT_FLOOR_SECONDS: x402_settlement_wait_until): a payment not
    proven by then is answered 202 settlement_pending, and the status URL or reconciliation
    finds it later. The work waits for what is left; work the request runs itself (inline,
    finishing in its start) still runs when nothing is left, since it takes no wait.
    """
    return time.monotonic() + _result_wait_seconds(offering)


def x402_settlement_wait_until(*, wait_until: float) -> float:
    """When the settlement's wait ends for a request whose budget ends at `wait_until`: then,
    but never sooner than SETTLEMENT_WAIT_FLOOR_SECONDS from now."""
    return max(wait_until, time.monotonic() + SETTLEMENT_WAIT_FLOOR_SECONDS)


@contextmanager
def x402_request_scope(*, offering: Offering, wait_until: float | None = None) -> Iterator[None]:
    """Around one x402 request that may settle a payment for `offering` and wait for its
    work: if the request will run that work itself, the execution job it stages is not sent
    to a worker unless the request leaves the job to one (result_wait).

    `wait_until`: the request's budget (x402_wait_budget), when it began before this scope
    (a scope entered again after a handed-off wait keeps it); None: a budget from now.
    """
    deadline = x402_wait_budget(offering=offering) if wait_until is None else wait_until
    budget = _BUDGET.set((offering.pk, deadline))
    try:
        with purchase_inline_execution_scope(
            offering=offering, wait_seconds=_result_wait_seconds(offering)
        ):
            yield
    finally:
        _BUDGET.reset(budget)


def x402_outcome_for_ref(*, ref: str) -> X402Outcome:
    """A paid purchase's outcome now, reconciling a pending settlement first (a resent
    payment's live answer)."""
    purchase = Purchase.objects.select_related("offering").get(ref=ref)
    return x402_outcome_for_purchase(purchase=purchase, reconcile=True)


def x402_outcome_for_capability(*, ref: str, token: str) -> X402Outcome:
    """What the capability URL shows: this purchase's status, or its result once ready.

    Reconciles a pending settlement first, exactly as a resent payment would.
    Raises DomainError: purchase_not_found (wrong token, another purchase's, or no purchase).
    """
    purchase = purchase_get_by_capability(ref=ref, token=token)
    with x402_request_scope(offering=purchase.offering):
        return x402_outcome_for_purchase(
            purchase=purchase, reconcile=True, channel="capability_url"
        )
