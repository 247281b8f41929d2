"""Recording a payment for a quote, on any rail: verify, deduplicate, record, commit.

The paid request's first phase (its loop over the recovery points is
purchases.services.checkout.flow, which keys it, settles and answers). The rail
(payments.rails) is never named here: it says how the payer is verified, how the attempt
is recorded and how its money moves.

A new payment for what the same payer already paid or is paying (same offering, canonical
input, API key and copy label, inside the offering's duplicate window) is answered with
that purchase and nothing is charged: stock x402 clients re-sign on every retry.

Write before money moves: the attempt and the purchase's move commit together. A rail that
settles when recorded (the prepaid balance) moves the money in that same transaction and
stores the answer with it. Any other rail settles after commit; whatever is not a proven
success or failure is `settlement_pending`, answered as such and reconciled, never paid
again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Generic, Protocol, TypeVar

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import QuerySet, Subquery
from django_fsm import ConcurrentTransition

from core.actors import Actor
from core.bulk import insert_unless_conflict
from core.errors import DomainError, ErrorCode
from core.prepared import PreparedQuery
from payments.models import PaymentAttempt, Rail
from payments.rails import Charge, PaymentRail, Presentation, QuoteTerms
from purchases import event_subjects as subjects
from purchases.events import (
    event_note,
    event_record,
    event_record_change,
    events_batched,
    purchase_move,
    purchase_move_record,
)
from purchases.models import Buyer, BuyerWallet, IdempotencyRecord, Offering, Purchase, Quote
from purchases.selectors import purchase_capability_url, purchase_duplicate_find
from purchases.services.checkout.duplicates import (
    duplicate_guard_lock,
    duplicate_key_for,
    purchase_duplicate_of_quote,
    purchase_duplicate_record,
    quote_release_if_unpaid,
)
from purchases.services.checkout.idempotency import (
    KeyClaim,
    StoredAnswer,
    payment_id_mark_recorded,
    payment_id_store_answer,
)
from purchases.services.fulfil.sweeper import purchase_execution_stage
from purchases.services.quote.offerings import offering_stock_take
from purchases.services.quote.quotes import quote_terms
from purchases.services.quote.top_ups import offering_is_top_up
from purchases.services.settle.authorization import authorization_hold
from purchases.services.shared.buyers import buyer_spend_cap_check

A = TypeVar("A")
A_co = TypeVar("A_co", covariant=True)


@dataclass(frozen=True)
class QuoteToPay:
    """The quote a payment names, with what was read beside it: the purchase this payment
    would repeat inside the offering's duplicate window, and the buyer the paying wallet is
    registered to (spend caps bind it; None: no such buyer, or an API key pays)."""

    quote: Quote
    duplicate_id: int | None = None
    payer_owner_id: int | None = None


@dataclass(frozen=True)
class PaymentRequest:
    """One presentation of payment, with who sent it and what for."""

    presentation: Presentation
    scope: str  # the key space its payment id lives in
    buyer: Buyer | None  # the authenticated buyer (API key), if any
    copy_label: str
    offering: Offering | None  # the paid URL's offering; None: the quote's
    now: datetime
    unstored: frozenset[ErrorCode]  # outcomes about the key itself, answered fresh each time
    # What the payment id binds to, if not the presentation's own fingerprint: the request
    # normalized (the rail's terms, the offering and the input), so a re-signed retry matches.
    fingerprint: str = ""
    # The door it came in by, written on a purchase it creates (Purchase.Channel).
    channel: str = Purchase.Channel.HTTP
    # A quote not written yet (its terms came signed with the payment, checked by the door),
    # written with the purchase, with what the door read beside it. None: the quote the
    # presentation names, read from the database.
    quote: QuoteToPay | None = None
    # Why the quote the payment carries cannot be paid (its signed terms are not ours),
    # answered under the payment's key where reading a quote would have refused it.
    quote_refusal: DomainError | None = None
    # When this request's wait for its settlement ends (a time.monotonic() value): the
    # door's wait budget (purchases.services.x402.outcomes). None: the rail's own limit.
    settle_wait_until: float | None = None
    # What the request's work runs inside, entered again after a returned wait (the x402
    # door's scope: its budget, and whether it runs the fulfilment itself).
    runs_in: Callable[[], AbstractContextManager[None]] = nullcontext

    @property
    def actor(self) -> Actor:
        return Actor.agent(self.presentation.payer)


class CheckoutAnswers(Protocol[A_co]):
    """How one API answers its clients: the orchestration decides when, the answers what."""

    def recorded(self, *, purchase: Purchase, attempt: PaymentAttempt) -> StoredAnswer:
        """A payment settled as it was recorded; stored in that transaction."""
        ...

    def settled(
        self, *, purchase: Purchase, attempt: PaymentAttempt | None, fresh: bool
    ) -> tuple[StoredAnswer, A_co]:
        """A payment after its rail settled it (or left it pending): (stored, sent).
        `fresh`: this request created the purchase (nothing else can exist on it yet)."""
        ...

    def duplicate(self, *, purchase: Purchase) -> StoredAnswer:
        """A new payment repeating `purchase`; stored, then rendered."""
        ...

    def refused(self, error: DomainError) -> StoredAnswer:
        """A refusal (a DomainError not about the key itself); stored, then rendered."""
        ...

    def render(self, stored: StoredAnswer, is_replay: bool) -> A_co:
        """A stored answer as the API sends it (a live one from the purchase as it is now)."""
        ...


class _Duplicate(Exception):
    def __init__(self, purchase: Purchase) -> None:
        super().__init__(purchase.ref)
        self.purchase = purchase


@dataclass(frozen=True)
class Checkout(Generic[A]):
    """One payment on its way through the flow, with what its rail said of it."""

    request: PaymentRequest
    answers: CheckoutAnswers[A]
    rail: PaymentRail
    # What the rail's verify returned: handed back to it, never derived twice per request.
    context: Any = None
    # The paying wallet's owner, read with the quote (QuoteToPay.payer_owner_id).
    payer_owner_id: int | None = None
    # The door sleeps through a wait for the money itself (flow.PaymentPending).
    returns_wait: bool = False


@dataclass(frozen=True)
class Recorded:
    """A payment recorded, committed with the key's recovery point: what its settlement
    starts from, as this request wrote it (nothing to read back)."""

    purchase: Purchase
    attempt: PaymentAttempt
    terms: QuoteTerms


def payment_record(checkout: Checkout[A], claim: KeyClaim) -> Recorded | A:
    """The first phase, from the `started` recovery point: verify the presentation, answer a
    repeat with what it repeats, else record the payment (one transaction). Returns what
    was recorded for the settlement, or the answer when nothing is left to settle (a
    repeat; a rail that settles when recorded). Raises DomainError with the payer's fix."""
    request, rail = checkout.request, checkout.rail
    if rail.settles_when_recorded:
        # Nothing to ask anyone outside the database: everything happens under the locks.
        return _record_and_answer(checkout, claim)
    if request.quote_refusal is not None:
        raise request.quote_refusal
    to_pay = request.quote or _quote_named(request, with_duplicate=True)
    quote, terms = to_pay.quote, quote_terms(quote=to_pay.quote)
    checkout = replace(
        checkout,
        context=rail.verify(presentation=request.presentation, terms=terms, now=request.now),
        payer_owner_id=to_pay.payer_owner_id,
    )
    duplicate_key = _duplicate_key(request, quote)
    # A duplicate is answered before anything is asked of the chain (found with the quote).
    duplicate = (
        Purchase.objects.select_related("offering", "quote").get(pk=to_pay.duplicate_id)
        if to_pay.duplicate_id is not None
        else None
    )
    if duplicate is not None:
        return _answer_duplicate(checkout, duplicate, quote, claim)
    search_from = rail.verify_funds(
        presentation=request.presentation, terms=terms, context=checkout.context
    )
    try:
        purchase, attempt, _ = _record(
            checkout=checkout,
            quote=quote,
            terms=terms,
            duplicate_key=duplicate_key,
            claim=claim,
            search_from=search_from,
        )
    except _Duplicate as found:
        return _answer_duplicate(checkout, found.purchase, quote, claim)
    return Recorded(purchase, attempt, terms)


def _record_and_answer(checkout: Checkout[A], claim: KeyClaim) -> A:
    """A rail that settles when recorded: one transaction reads the quote under its lock,
    records and settles the payment, and stores the answer."""
    request = checkout.request
    with transaction.atomic():
        to_pay = _quote_named(request, lock=True)
        quote, terms = to_pay.quote, quote_terms(quote=to_pay.quote)
        checkout = replace(
            checkout,
            context=checkout.rail.verify(
                presentation=request.presentation, terms=terms, now=request.now
            ),
            payer_owner_id=to_pay.payer_owner_id,
        )
        try:
            _, _, stored = _record(
                checkout=checkout,
                quote=quote,
                terms=terms,
                duplicate_key=_duplicate_key(request, quote),
                claim=claim,
                search_from=None,
            )
        except _Duplicate as found:
            duplicate = found.purchase
        else:
            assert stored is not None
            return checkout.answers.render(stored, False)
    return _answer_duplicate(checkout, duplicate, quote, claim)


def _duplicate_key(request: PaymentRequest, quote: Quote) -> str:
    return duplicate_key_for(
        payer=request.presentation.payer,
        buyer_ref=request.buyer.ref if request.buyer else None,
        offering=quote.offering,
        input_hash=quote.input_hash,
        copy_label=request.copy_label,
    )


def _quote_named(
    request: PaymentRequest, *, lock: bool = False, with_duplicate: bool = False
) -> QuoteToPay:
    """The quote the payment names, if this payer may pay it, with the paying wallet's owner
    when no API key pays. `with_duplicate`: with the purchase this payment would repeat.

    A quote opened with an API key is its buyer's: paid with that key, or without a key from
    a wallet registered to that buyer. Anyone else's payment never touches it (nor learns it
    exists). Raises DomainError: quote_not_found.
    """
    shape = _QuoteShape(
        wallet_owner=request.buyer is None,
        duplicate=with_duplicate,
        of_offering=request.offering is not None,
        lock=lock,
    )
    values: dict[str, object] = {"public_id": request.presentation.quote_id or ""}
    if shape.wallet_owner:
        values["payer_lower"] = request.presentation.payer.lower()
    if shape.duplicate:
        values.update(
            payer=request.presentation.payer.lower(),
            buyer_ref=request.buyer.ref if request.buyer else "",
            copy_label=request.copy_label,
            now=request.now,
        )
    if request.offering is not None:
        values["offering_id"] = request.offering.pk
    quote = _quote_query(shape).first(**values)
    if quote is None or not _may_pay(quote, request):
        detail = "accepted.extra.quote names no quote of this offering." if request.offering else ""
        raise DomainError(ErrorCode.QUOTE_NOT_FOUND, detail)
    # The annotations read with the quote (see _quote_query), taken off it.
    extra = vars(quote)
    return QuoteToPay(quote, extra.pop("duplicate_id", None), extra.pop("payer_owner_id", None))


@dataclass(frozen=True)
class _QuoteShape:
    wallet_owner: bool  # no API key: the paying wallet's owner comes with the quote
    duplicate: bool  # with the purchase this payment would repeat
    of_offering: bool  # only the paid URL's offering's quotes
    lock: bool


@functools.cache
def _quote_query(shape: _QuoteShape) -> PreparedQuery[Quote]:
    """The read of _quote_named in one shape, compiled once per process (core.prepared):
    every paid request runs it, and its subqueries cost more to compile than to run."""
    parameters: dict[str, type] = {"public_id": str}
    if shape.wallet_owner:
        parameters["payer_lower"] = str
    if shape.duplicate:
        parameters.update(payer=str, buyer_ref=str, copy_label=str, now=datetime)
    if shape.of_offering:
        parameters["offering_id"] = int

    def build(**values: Any) -> QuerySet[Quote]:
        quotes = Quote.objects.select_related("offering").filter(public_id=values["public_id"])
        if shape.wallet_owner:
            # The paying wallet's owner (spend caps bind it) comes with the quote, not in a
            # query of its own. A buyer with an API key is capped as itself: not needed then.
            owner = BuyerWallet.objects.filter(address=values["payer_lower"])
            quotes = quotes.annotate(payer_owner_id=Subquery(owner.values("buyer_id")[:1]))
        if shape.duplicate:
            quotes = quotes.annotate(
                duplicate_id=purchase_duplicate_of_quote(
                    payer=values["payer"],
                    buyer_ref=values["buyer_ref"],
                    copy_label=values["copy_label"],
                    now=values["now"],
                )
            )
        if shape.of_offering:
            quotes = quotes.filter(offering_id=values["offering_id"])
        if shape.lock:
            quotes = quotes.select_for_update(of=("self",))
        return quotes.order_by("pk")[:1]  # as first() reads it

    return PreparedQuery(build, **parameters)


def _may_pay(quote: Quote, request: PaymentRequest) -> bool:
    if quote.buyer_id is None:
        return True  # an anonymous quote: whoever pays it first
    if request.buyer is not None:
        return request.buyer.pk == quote.buyer_id
    return BuyerWallet.objects.filter(
        buyer_id=quote.buyer_id, address=request.presentation.payer
    ).exists()


def _record(
    *,
    checkout: Checkout[A],
    quote: Quote,
    terms: QuoteTerms,
    duplicate_key: str,
    claim: KeyClaim,
    search_from: int | None,
) -> tuple[Purchase, PaymentAttempt, StoredAnswer | None]:
    """One transaction: the attempt, the purchase's move and the key's recovery point.

    Racing payments for one duplicate key serialize on its guard row: the first records,
    the others find its purchase and raise _Duplicate.
    Raises DomainError: quote_already_paid, quote_expired, spend_cap_exceeded, sold_out,
    and what the rail's record raises (insufficient_funds).
    """
    try:
        try:
            return _record_once(
                checkout=checkout,
                quote=quote,
                terms=terms,
                duplicate_key=duplicate_key,
                claim=claim,
                search_from=search_from,
            )
        except ConcurrentTransition:
            # The quote moved since it was read (another payment, expiry): nothing was
            # written; again under its lock, which says what happened to it.
            return _record_once(
                checkout=checkout,
                quote=quote,
                terms=terms,
                duplicate_key=duplicate_key,
                claim=claim,
                search_from=search_from,
                lock_quote=True,
            )
    except IntegrityError:
        # Two presentations of one payment raced past verification: the database lets
        # exactly one through; the rail names the winner's purchase.
        checkout.rail.refuse_if_taken(presentation=checkout.request.presentation, terms=terms)
        raise


def _record_once(
    *,
    checkout: Checkout[A],
    quote: Quote,
    terms: QuoteTerms,
    duplicate_key: str,
    claim: KeyClaim,
    search_from: int | None,
    lock_quote: bool = False,
) -> tuple[Purchase, PaymentAttempt, StoredAnswer | None]:
    """`lock_quote`: read the quote again under its lock first. Without it, a quote read
    open (before verification, unlocked) is accepted by an UPDATE conditional on its still
    being open, which is then the lock; ConcurrentTransition if it is not."""
    request, rail = checkout.request, checkout.rail
    actor, now = request.actor, request.now
    if request.presentation.rail == Rail.PREPAID and offering_is_top_up(quote.offering):
        raise DomainError(
            ErrorCode.UNSUPPORTED_RAIL,
            "A top-up is paid over x402, never from the balance it credits.",
        )
    # A rail that settles when recorded runs this inside _record_and_answer's transaction:
    # no savepoint there (two round trips), since anything raised ends that whole one.
    with transaction.atomic(savepoint=not rail.settles_when_recorded), events_batched():
        if quote.offering.duplicate_window:
            is_new_key = duplicate_guard_lock(duplicate_key=duplicate_key, now=now)
            duplicate = (
                None
                if is_new_key
                else purchase_duplicate_find(
                    offering=quote.offering, duplicate_key=duplicate_key, now=now
                )
            )
            if duplicate is not None:
                raise _Duplicate(duplicate)
        if lock_quote or (not rail.settles_when_recorded and quote.state != Quote.State.OPEN):
            # By public id: an unwritten quote has no pk until a racing payment wrote it.
            quote = (
                Quote.objects.select_for_update(of=("self",))
                .select_related("offering")
                .get(public_id=quote.public_id)
            )
        purchase = _purchase_for_payment(request, quote, duplicate_key, checkout.payer_owner_id)
        is_new = purchase.pk is None
        # The moves are made before the row is written (a new purchase is one INSERT) and
        # put on the timeline after the attempt they name.
        held = _is_held_flow(rail, quote.offering)
        if rail.settles_when_recorded:
            pay = purchase_move(
                purchase=purchase, transition=purchase.payment_complete, arguments={"paid_at": now}
            )
            run = purchase_move(purchase=purchase, transition=purchase.fulfillment_queue)
        elif held:
            # The authorization flow: held, and the work queued before any money moves.
            pay = purchase_move(purchase=purchase, transition=purchase.payment_authorize)
            run = purchase_move(purchase=purchase, transition=purchase.fulfillment_queue)
        else:
            pay, run = purchase_move(purchase=purchase, transition=purchase.payment_begin), None
        if is_new:
            # Before the purchase: the quote's row is the lock (an unwritten one: its INSERT).
            was = _quote_accept(quote) if quote.pk is not None else _quote_write(quote)
            purchase.save()
            event_record(
                subject="quote",
                quote=quote,
                purchase=purchase,
                actor=actor,
                from_state=was,
                to_state=quote.state,
            )
        else:
            purchase.save(update_fields=[*_MOVED_FIELDS, "updated_at"])
        attempt, change = rail.record(
            charge=Charge(
                purchase_id=purchase.pk,
                purchase_ref=purchase.ref,
                buyer_id=purchase.buyer_id,
                presentation=request.presentation,
                terms=terms,
                idempotency_record_id=claim.record_id,
                search_from_block=search_from,
                context=checkout.context,
            )
        )
        event_record_change(purchase=purchase, actor=actor, change=change)
        purchase_move_record(
            purchase=purchase,
            move=pay,
            actor=actor,
            evidence={"rail": purchase.rail, "attempt": attempt.pk},
        )
        if held:
            authorization_hold(purchase=purchase, attempt=attempt, actor=actor)
            assert run is not None
            purchase_move_record(purchase=purchase, move=run, actor=actor)
            payment_id_mark_recorded(claim=claim, purchase=purchase)
            purchase_execution_stage(purchase_id=purchase.pk, now=now)
            return purchase, attempt, None
        if run is None:
            payment_id_mark_recorded(claim=claim, purchase=purchase)
            return purchase, attempt, None
        purchase_move_record(purchase=purchase, move=run, actor=actor)
        stored = checkout.answers.recorded(purchase=purchase, attempt=attempt)
        payment_id_store_answer(claim=claim, answer=stored, purchase=purchase, now=now)
        purchase_execution_stage(purchase_id=purchase.pk, now=now)
        return purchase, attempt, stored


def _is_held_flow(rail: PaymentRail, offering: Offering) -> bool:
    """Recorded held, settled after the work (Offering.DeliveryCondition.AUTHORIZATION):
    only a rail that settles after recording can hold; a prepaid balance settles at once."""
    return not rail.settles_when_recorded and offering.settles_after_work


_MOVED_FIELDS = [
    "payment_state",
    "fulfillment_state",
    "paid_at",
    "reason_code",
    "rail",
    "payer",
    "duplicate_key",
]


def _purchase_for_payment(
    request: PaymentRequest, quote: Quote, duplicate_key: str, payer_owner_id: int | None
) -> Purchase:
    """The purchase this payment goes to: the quote's (if its last payment failed) or a new
    one, not yet written (one per quote, by the database). Caller holds the quote's lock.
    `payer_owner_id`: the paying wallet's owner, read with the quote.

    Raises DomainError: quote_already_paid, quote_expired, spend_cap_exceeded, sold_out.
    """
    presentation, now = request.presentation, request.now
    purchase = purchase_open_for_payment(quote=quote, now=now)
    capped = (
        request.buyer
        or quote.buyer
        or (Buyer.objects.get(pk=payer_owner_id) if payer_owner_id is not None else None)
    )
    if capped is not None:
        # Spend caps bind the paying wallet's owner whichever rail it pays on.
        buyer_spend_cap_check(
            buyer=capped,
            amount=quote.price,
            now=now,
            purchase_ref=purchase.ref if purchase else None,
        )
    if purchase is None:
        if not quote.holds_stock and quote.offering.stock is not None:
            # Anonymous quotes hold nothing: stock is taken when a valid payment arrives.
            if not offering_stock_take(offering_id=quote.offering_id):
                raise DomainError(ErrorCode.SOLD_OUT)
            quote.holds_stock = True
        purchase = Purchase(
            quote=quote,
            offering=quote.offering,
            buyer=request.buyer or quote.buyer,
            amount=quote.price,
            asset=quote.asset,
            network=quote.network,
            channel=request.channel,
        )
    purchase.rail, purchase.payer = presentation.rail, presentation.payer
    purchase.duplicate_key = duplicate_key
    return purchase


def purchase_open_for_payment(*, quote: Quote, now: datetime) -> Purchase | None:
    """The quote's purchase if a new payment may go to it (its last one failed), else None
    for a first payment. Caller holds the quote's row lock.

    Raises DomainError: quote_already_paid (naming the purchase), quote_expired.
    """
    purchase = (
        None
        if quote.state == Quote.State.OPEN  # accepted with its purchase, in one transaction
        else Purchase.objects.select_for_update().filter(quote=quote).first()
    )
    if purchase is not None and purchase.payment_state != Purchase.PaymentState.FAILED:
        raise DomainError(
            ErrorCode.QUOTE_ALREADY_PAID,
            purchase=purchase.ref,
            extra={"existing_purchase": purchase.ref},
        )
    if quote.state == Quote.State.EXPIRED or quote.expires_at <= now:
        raise DomainError(ErrorCode.QUOTE_EXPIRED, purchase=purchase.ref if purchase else None)
    return purchase


def _quote_accept(quote: Quote) -> str:
    """The first payment accepts the quote: one UPDATE conditional on the state it was read
    in (ConcurrentTransition if it moved). Returns that state, for the timeline."""
    was = quote.state
    quote.accept()
    quote.save(update_fields=["state", "holds_stock"])
    return str(was)


def _quote_write(quote: Quote) -> str:
    """The first payment of an unwritten quote writes it, accepted: one INSERT unless a
    racing payment of the same quote wrote it first (ConcurrentTransition: read again under
    its lock, which says what became of it). Returns the state it was offered in."""
    quote.accept()
    if not insert_unless_conflict(quote, conflict="(public_id)"):
        raise ConcurrentTransition(f"quote {quote.public_id} was written by another payment")
    event_record(
        subject="quote",
        quote=quote,
        actor=Actor.agent("anonymous"),
        to_state=Quote.State.OPEN,
        evidence={"offering": quote.offering.slug, "anonymous": True, "signed": True},
    )
    return str(Quote.State.OPEN)


def _answer_duplicate(
    checkout: Checkout[A], purchase: Purchase, quote: Quote, claim: KeyClaim
) -> A:
    """Answer a repeat with the purchase it repeats; nothing is charged or broadcast.

    Raises DomainError: payment_in_flight while the purchase's own request still runs.
    """
    request = checkout.request
    if _payment_in_flight(purchase, request.now):
        event_note(
            subject=subjects.PAYMENT_ID_IN_FLIGHT,
            purchase=purchase,
            actor=request.actor,
            reason_code=ErrorCode.PAYMENT_IN_FLIGHT,
            evidence={"scope": request.scope, "repeated_by": "duplicate", "quote": quote.public_id},
        )
        raise DomainError(
            ErrorCode.PAYMENT_IN_FLIGHT,
            "This payment repeats a purchase whose own payment is still being processed: "
            "poll its status URL, or call again after Retry-After. Nothing was charged.",
            purchase=purchase.ref,
            retry_after=settings.TOLLBOOTH["RETRY_AFTER_SECONDS"],
            extra={
                "status_url": purchase_capability_url(purchase=purchase),
                "duplicate_of": purchase.ref,
            },
        )
    with transaction.atomic(), events_batched():
        purchase_duplicate_record(
            purchase=purchase,
            actor=request.actor,
            rail=request.presentation.rail,
            evidence={
                **request.presentation.summary,
                "quote": quote.public_id,
                "copy_label": request.copy_label,
            },
        )
        if quote.pk is not None:  # an unwritten quote holds nothing to release
            quote_release_if_unpaid(quote=quote, actor=request.actor)
        stored = checkout.answers.duplicate(purchase=purchase)
        payment_id_store_answer(claim=claim, answer=stored, purchase=purchase, now=request.now)
    return checkout.answers.render(stored, False)


def _payment_in_flight(purchase: Purchase, now: datetime) -> bool:
    return (
        purchase.payment_state in (Purchase.PaymentState.PAYING, Purchase.PaymentState.AUTHORIZED)
        and IdempotencyRecord.objects.filter(
            purchase=purchase, state=IdempotencyRecord.State.IN_FLIGHT, locked_until__gt=now
        ).exists()
    )
