"""Paying for a quote on the prepaid rail: one transaction records the attempt, debits the
ledger, marks the purchase paid and stores the answer; the execution is enqueued after commit."""

from __future__ import annotations

from datetime import datetime
from functools import partial

from django.db import transaction

from payments import services as payment_services
from purchases.canonical import fingerprint
from purchases.clock import now_or
from purchases.errors import DomainError, ErrorCode
from purchases.events import Actor, event_record
from purchases.models import Buyer, Purchase, Quote
from purchases.selectors import purchase_status
from purchases.services.idempotency import (
    KeyClaim,
    StoredAnswer,
    payment_id_claim,
    payment_id_release,
    payment_id_store_answer,
    payment_id_validate,
)

PREPAID_SCOPE = "prepaid"
PROBLEM_HEADERS = {"Content-Type": "application/problem+json"}
# Outcomes about the key itself are answered fresh each time, never stored as the key's answer.
UNSTORED_CODES = {
    ErrorCode.PAYMENT_IN_FLIGHT,
    ErrorCode.PAYMENT_IDENTIFIER_CONFLICT,
    ErrorCode.RETENTION_EXPIRED,
}


def purchase_pay_prepaid(
    *, buyer: Buyer, quote_id: str, payment_id: str | None, now: datetime | None = None
) -> tuple[StoredAnswer, bool]:
    """Pay a quote from the buyer's balance. Returns (answer, is_replay).

    Raises DomainError: idempotency_key_missing, idempotency_key_invalid,
    payment_identifier_conflict, payment_in_flight (never stored). Every other domain
    outcome (quote_not_found, quote_expired, quote_already_paid, insufficient_funds,
    spend_cap_exceeded) is stored as the key's answer and returned.
    """
    now = now_or(now)
    key = payment_id_validate(key=payment_id)
    request_fingerprint = fingerprint({"quote": quote_id, "rail": "prepaid"})
    claim = payment_id_claim(
        scope=PREPAID_SCOPE, key=key, principal=buyer.ref, fingerprint=request_fingerprint, now=now
    )
    if claim.replay is not None:
        return claim.replay, True
    try:
        return _pay_and_answer(buyer, quote_id, key, request_fingerprint, claim, now), False
    except DomainError as error:
        if error.code in UNSTORED_CODES:
            raise
        answer = StoredAnswer(
            error.spec.status, error.as_problem(), PROBLEM_HEADERS, error.purchase
        )
        payment_id_store_answer(claim=claim, answer=answer, purchase=None, now=now)
        return answer, False
    except Exception:
        payment_id_release(claim=claim)
        raise


@transaction.atomic
def _pay_and_answer(
    buyer: Buyer, quote_id: str, key: str, request_fingerprint: str, claim: KeyClaim, now: datetime
) -> StoredAnswer:
    actor = Actor.agent(buyer.ref)
    purchase = _purchase_for_payment(buyer, quote_id, now, actor)
    payment_services.prepaid_attempt_settle(
        purchase=purchase,
        buyer=buyer,
        payment_id=key,
        scope=PREPAID_SCOPE,
        fingerprint=request_fingerprint,
        now=now,
        actor=actor,
    )
    previous = purchase.payment_state
    purchase.payment_complete(paid_at=now)
    purchase.rail, purchase.payer = Purchase.Rail.PREPAID, buyer.ref
    purchase.fulfillment_queue()
    purchase.save(
        update_fields=[
            "payment_state",
            "fulfillment_state",
            "paid_at",
            "reason_code",
            "rail",
            "payer",
            "updated_at",
        ]
    )
    event_record(
        subject="purchase.payment",
        purchase=purchase,
        actor=actor,
        from_state=previous,
        to_state=purchase.payment_state,
        evidence={"rail": "prepaid"},
    )
    event_record(
        subject="purchase.fulfillment",
        purchase=purchase,
        actor=actor,
        from_state=Purchase.FulfillmentState.NOT_STARTED,
        to_state=purchase.fulfillment_state,
    )
    answer = StoredAnswer(201, purchase_status(purchase=purchase, now=now), {}, purchase.ref)
    payment_id_store_answer(claim=claim, answer=answer, purchase=purchase, now=now)
    from purchases.tasks import purchase_execute_task  # tasks import services; break the cycle here

    transaction.on_commit(partial(purchase_execute_task.delay, purchase_id=purchase.pk))
    return answer


def purchase_open_for_payment(*, quote: Quote, now: datetime) -> Purchase | None:
    """The quote's purchase if a new payment may go to it (its last one failed), else None
    for a first payment. Both rails ask this under the quote's row lock.

    Raises DomainError: quote_already_paid (naming the purchase), quote_expired.
    """
    purchase = Purchase.objects.select_for_update().filter(quote=quote).first()
    if purchase is not None and purchase.payment_state != Purchase.PaymentState.FAILED:
        raise DomainError(
            ErrorCode.QUOTE_ALREADY_PAID,
            purchase=purchase.ref,
            extra={"existing_purchase": purchase.ref},
        )
    if quote.state == Quote.State.EXPIRED or quote.expires_at <= now:
        raise DomainError(ErrorCode.QUOTE_EXPIRED, purchase=purchase.ref if purchase else None)
    return purchase


def purchase_create_for_quote(
    *, quote: Quote, buyer: Buyer | None, rail: str, payer: str, actor: Actor
) -> Purchase:
    """The first payment accepts the quote: its purchase is created (one per quote, by the
    database) and the quote moves to accepted. Caller holds the quote row lock."""
    purchase = Purchase.objects.create(
        quote=quote,
        offering=quote.offering,
        buyer=buyer,
        amount=quote.price,
        asset=quote.asset,
        network=quote.network,
        rail=rail,
        payer=payer,
    )
    quote.accept()
    quote.save(update_fields=["state", "holds_stock"])
    event_record(
        subject="quote",
        quote=quote,
        purchase=purchase,
        actor=actor,
        from_state=Quote.State.OPEN,
        to_state=quote.state,
    )
    return purchase


def _purchase_for_payment(buyer: Buyer, quote_id: str, now: datetime, actor: Actor) -> Purchase:
    """Lock the quote and return the purchase a new payment may go to (creating it on first use).

    Raises DomainError: quote_not_found, quote_expired, quote_already_paid.
    """
    quote = (
        Quote.objects.select_for_update(of=("self",))
        .select_related("offering")
        .filter(public_id=quote_id, buyer=buyer)
        .first()
    )
    if quote is None:
        raise DomainError(ErrorCode.QUOTE_NOT_FOUND)
    purchase = purchase_open_for_payment(quote=quote, now=now)
    if purchase is not None:
        return purchase
    return purchase_create_for_quote(
        quote=quote, buyer=buyer, rail=Purchase.Rail.PREPAID, payer=buyer.ref, actor=actor
    )
