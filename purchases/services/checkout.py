"""Paying for a quote on the prepaid rail: one transaction records the attempt, debits the
ledger, marks the purchase paid and stores the answer; the execution is enqueued after commit."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import transaction

from core.actors import Actor
from core.canonical import fingerprint
from core.clock import now_or
from core.errors import DomainError, ErrorCode
from payments import services as payment_services
from payments.models import Rail
from payments.services import PrepaidCharge
from purchases.events import event_record, event_record_change, events_batched
from purchases.models import Buyer, Purchase, Quote
from purchases.selectors import purchase_status
from purchases.services.buyers import buyer_spend_cap_check
from purchases.services.duplicates import (
    DUPLICATE_HEADER,
    copy_label_validate,
    duplicate_guard_lock,
    duplicate_key_for,
    purchase_duplicate_find,
    purchase_duplicate_record,
    quote_release_if_unpaid,
)
from purchases.services.idempotency import (
    KeyClaim,
    KeyedRequest,
    StoredAnswer,
    idempotent_request,
    payment_id_store_answer,
    payment_id_validate,
)
from purchases.services.sweeper import purchase_execution_stage

PREPAID_SCOPE = "prepaid"
# Outcomes about the key itself are answered fresh each time, never stored as the key's answer.
UNSTORED_CODES = frozenset(
    {
        ErrorCode.PAYMENT_IN_FLIGHT,
        ErrorCode.PAYMENT_IDENTIFIER_CONFLICT,
        ErrorCode.RETENTION_EXPIRED,
    }
)


def purchase_pay_prepaid(
    *,
    buyer: Buyer,
    quote_id: str,
    payment_id: str | None,
    copy_label: str | None = None,
    now: datetime | None = None,
) -> tuple[StoredAnswer, bool]:
    """Pay a quote from the buyer's balance. Returns (answer, is_replay).

    A new key for what this buyer already bought (same offering and input, same copy label)
    inside the offering's duplicate window is answered 200 with that purchase, marked as a
    duplicate, and nothing is debited.
    Raises DomainError: idempotency_key_missing, idempotency_key_invalid, copy_label_invalid,
    payment_identifier_conflict, payment_in_flight (never stored). Every other domain
    outcome (quote_not_found, quote_expired, quote_already_paid, insufficient_funds,
    spend_cap_exceeded) is stored as the key's answer and returned.
    """
    now = now_or(now)
    key = payment_id_validate(key=payment_id)
    label = copy_label_validate(label=copy_label)
    request = {"quote": quote_id, "rail": "prepaid", **({"copy": label} if label else {})}
    request_fingerprint = fingerprint(request)
    payment = _PrepaidPayment(buyer, quote_id, key, request_fingerprint, label, now)
    return idempotent_request(
        request=KeyedRequest(
            scope=PREPAID_SCOPE,
            key=key,
            principal=buyer.ref,
            fingerprint=request_fingerprint,
            now=now,
            unstored=UNSTORED_CODES,
        ),
        work=lambda claim: (_pay_and_answer(payment, claim), False),
        render=lambda answer, is_replay: (answer, is_replay),
    )


@dataclass(frozen=True)
class _PrepaidPayment:
    buyer: Buyer
    quote_id: str
    key: str
    fingerprint: str
    copy_label: str
    now: datetime


@transaction.atomic
def _pay_and_answer(payment: _PrepaidPayment, claim: KeyClaim) -> StoredAnswer:
    with events_batched():  # the flow's timeline in one INSERT
        return _pay_in_transaction(payment, claim)


def _pay_in_transaction(payment: _PrepaidPayment, claim: KeyClaim) -> StoredAnswer:
    buyer, now = payment.buyer, payment.now
    actor = Actor.agent(buyer.ref)
    quote = _quote_for_payment(buyer, payment.quote_id)
    duplicate_key = duplicate_key_for(
        payer=buyer.ref,
        buyer_ref=buyer.ref,
        offering=quote.offering,
        input_hash=quote.input_hash,
        copy_label=payment.copy_label,
    )
    if quote.offering.duplicate_window:
        duplicate_guard_lock(duplicate_key=duplicate_key)
        duplicate = purchase_duplicate_find(
            offering=quote.offering, duplicate_key=duplicate_key, now=now
        )
        if duplicate is not None:
            return _answer_duplicate(payment, duplicate, quote, claim)
    purchase = _purchase_for_payment(buyer, quote, now, actor)
    buyer_spend_cap_check(buyer=buyer, amount=purchase.amount, now=now)
    attempt, change = payment_services.prepaid_attempt_settle(
        charge=PrepaidCharge(
            purchase_id=purchase.pk,
            purchase_ref=purchase.ref,
            buyer_id=buyer.pk,
            buyer_ref=buyer.ref,
            amount=purchase.amount,
            asset=purchase.asset,
            idempotency_record_id=claim.record_id,
            fingerprint=payment.fingerprint,
        )
    )
    event_record_change(purchase=purchase, actor=actor, change=change)
    previous = purchase.payment_state
    purchase.payment_complete(paid_at=now)
    purchase.rail, purchase.payer = Rail.PREPAID, buyer.ref
    purchase.duplicate_key = duplicate_key
    purchase.fulfillment_queue()
    purchase.save(
        update_fields=[
            "payment_state",
            "fulfillment_state",
            "paid_at",
            "reason_code",
            "rail",
            "payer",
            "duplicate_key",
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
    status = purchase_status(purchase=purchase, now=now, created_with=attempt)
    answer = StoredAnswer(201, status, {}, purchase.ref)
    payment_id_store_answer(claim=claim, answer=answer, purchase=purchase, now=now)
    purchase_execution_stage(purchase_id=purchase.pk, now=now)
    return answer


def _answer_duplicate(
    payment: _PrepaidPayment, purchase: Purchase, quote: Quote, claim: KeyClaim
) -> StoredAnswer:
    """The purchase this key repeats, marked as a duplicate; nothing is debited."""
    actor = Actor.agent(payment.buyer.ref)
    purchase_duplicate_record(
        purchase=purchase,
        actor=actor,
        rail="prepaid",
        evidence={"quote": quote.public_id, "copy_label": payment.copy_label},
    )
    quote_release_if_unpaid(quote=quote, actor=actor)
    body = {**purchase_status(purchase=purchase, now=payment.now), "duplicate_of": purchase.ref}
    answer = StoredAnswer(200, body, {DUPLICATE_HEADER: purchase.ref}, purchase.ref)
    payment_id_store_answer(claim=claim, answer=answer, purchase=purchase, now=payment.now)
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


def _quote_for_payment(buyer: Buyer, quote_id: str) -> Quote:
    """Raises DomainError: quote_not_found (another buyer's quote is not found either)."""
    quote = Quote.objects.select_related("offering").filter(public_id=quote_id, buyer=buyer).first()
    if quote is None:
        raise DomainError(ErrorCode.QUOTE_NOT_FOUND)
    return quote


def _purchase_for_payment(buyer: Buyer, quote: Quote, now: datetime, actor: Actor) -> Purchase:
    """Lock the quote and return the purchase a new payment may go to (creating it on first use).

    Raises DomainError: quote_expired, quote_already_paid.
    """
    quote = (
        Quote.objects.select_for_update(of=("self",)).select_related("offering").get(pk=quote.pk)
    )
    purchase = purchase_open_for_payment(quote=quote, now=now)
    if purchase is not None:
        return purchase
    return purchase_create_for_quote(
        quote=quote, buyer=buyer, rail=Rail.PREPAID, payer=buyer.ref, actor=actor
    )
