"""The paid request: one loop over its recovery points, for every rail and every door.

The payment id (its idempotency key) records the last phase a request committed. A request
claims the key, or takes over the claim of one that died, and goes on from there:

    claim the payment id
      finished           its stored answer, replayed (a live one from the purchase as it is)
      started            verify, answer a repeat, record the payment        (transaction 1)
      payment recorded   settle over the rail, record the outcome           (transaction 2)
                         answer from the purchase, store the answer         (transaction 3)
        ... held         (the authorization flow: the attempt recorded held, the work queued)
                         wait for the work's terminal move, which captures or releases the
                         authorization; settle a captured one as above, answer a released one

No transaction is open while the money moves: the settlement runs after the recording
committed, and a request that dies there is resumed by the next one from `payment
recorded`, with the recorded authorization (a re-signed retry is never recorded beside it).

A wait for the money (a block) does not hold the request's thread when its door can sleep
on an event loop (`purchase_pay(..., returns_wait=True)`: the x402 paid URL and the MCP door
served by ASGI). The loop then returns the wait as a value, `PaymentPending`, with the key
still claimed; the door sleeps through `pending.receipt` and calls `purchase_pay_resume`,
which records the outcome the wait ended on and answers, under the same key and in the same
scope. Anywhere else the wait is slept through on this thread. Either way the same code
records and answers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Generic, Literal, TypeVar, overload

from django.conf import settings

from core.waits import Awaiting
from payments.models import PaymentAttempt
from payments.rails import SettlementOutcome, rail_for
from payments.selectors import payment_attempt_for_key
from purchases.models import IdempotencyRecord, Purchase
from purchases.selectors import purchase_reload
from purchases.services.checkout.checkout import (
    Checkout,
    CheckoutAnswers,
    PaymentRequest,
    Recorded,
    payment_record,
)
from purchases.services.checkout.idempotency import (
    ClaimHeld,
    KeyClaim,
    KeyedRequest,
    payment_id_claim,
    payment_id_store_answer,
    payment_id_work,
)
from purchases.services.fulfil.result_wait import purchase_await_result
from purchases.services.settle.settlement import (
    Settled,
    SettlementUnderWay,
    purchase_settle_attempt_or_wait,
    settlement_finish,
)

A = TypeVar("A")


@dataclass(frozen=True)
class PaymentPending(ClaimHeld, Generic[A]):
    """The money was sent and is not proven yet: the wait for it (`receipt`), and where
    the flow stands, so that `purchase_pay_resume` reads nothing again. The key stays
    claimed until the resume ends."""

    checkout: Checkout[A]
    claim: KeyClaim
    purchase: Purchase
    settlement: SettlementUnderWay
    fresh: bool

    @property
    def receipt(self) -> Awaiting[SettlementOutcome]:
        return self.settlement.receipt


@overload
def purchase_pay(
    *, request: PaymentRequest, answers: CheckoutAnswers[A], returns_wait: Literal[False] = ...
) -> A: ...
@overload
def purchase_pay(
    *, request: PaymentRequest, answers: CheckoutAnswers[A], returns_wait: bool
) -> A | PaymentPending[A]: ...
def purchase_pay(
    *, request: PaymentRequest, answers: CheckoutAnswers[A], returns_wait: bool = False
) -> A | PaymentPending[A]:
    """Take one payment under the payment-id rules and move its money at most once.

    Raises DomainError for the codes in `request.unstored`; every other outcome is stored as
    the key's answer (or live) and returned rendered. `returns_wait`: a wait for the money
    comes back as PaymentPending (see the module's docstring).
    """
    rail = rail_for(request.presentation.rail)
    checkout = Checkout(request, answers, rail, returns_wait=returns_wait)
    keyed = _keyed(request)
    with request.runs_in():
        claim = payment_id_claim(request=keyed)
        if claim.replay is not None:
            return answers.render(claim.replay, True)
        return payment_id_work(
            request=keyed,
            claim=claim,
            run=lambda: _from_recovery_point(checkout, claim),
            refused=answers.refused,
            render=answers.render,
        )


def purchase_pay_resume(pending: PaymentPending[A], outcome: SettlementOutcome) -> A:
    """After the door slept through `pending.receipt`: record the outcome the wait ended
    on and answer, under the same key and in the same scope, as the blocking wait would
    have gone on."""
    checkout, claim = pending.checkout, pending.claim

    def finish() -> A:
        settled = settlement_finish(under_way=pending.settlement, outcome=outcome)
        return _answer(checkout, claim, pending.purchase, settled, fresh=pending.fresh)

    with checkout.request.runs_in():
        return payment_id_work(
            request=_keyed(checkout.request),
            claim=claim,
            run=finish,
            refused=checkout.answers.refused,
            render=checkout.answers.render,
        )


def _from_recovery_point(checkout: Checkout[A], claim: KeyClaim) -> A | PaymentPending[A]:
    match claim.recovery_point:
        case IdempotencyRecord.RecoveryPoint.STARTED:
            return _record_and_settle(checkout, claim)
        case _:
            # A request holding this id died after recording the payment: settle what it
            # recorded, whatever authorization this retry carries.
            attempt = payment_attempt_for_key(idempotency_record_id=claim.record_id)
            if attempt is None:
                return _record_and_settle(checkout, claim)
            if attempt.state == PaymentAttempt.State.HELD:
                return _work_then_settle(checkout, claim, attempt.purchase, attempt.pk, fresh=False)
            return _settle(checkout, claim, attempt.purchase, attempt.pk, None, fresh=False)


def _record_and_settle(checkout: Checkout[A], claim: KeyClaim) -> A | PaymentPending[A]:
    recorded = payment_record(checkout, claim)
    if not isinstance(recorded, Recorded):
        return recorded  # answered: a repeat, or a rail that settled as it recorded
    purchase, attempt = recorded.purchase, recorded.attempt
    if attempt.state == PaymentAttempt.State.HELD:
        return _work_then_settle(checkout, claim, purchase, attempt.pk, fresh=True)
    return _settle(checkout, claim, purchase, attempt.pk, recorded, fresh=True)


def _work_then_settle(
    checkout: Checkout[A], claim: KeyClaim, purchase: Purchase, attempt_id: int, *, fresh: bool
) -> A | PaymentPending[A]:
    """The authorization flow: the work first, inside the request's budget (run here when
    it is fast), then the settlement its terminal move captured. Work still running, or a
    released authorization, is answered from the purchase as it is."""
    request = checkout.request
    until = request.settle_wait_until
    wait = (until - time.monotonic()) if until is not None else _work_wait_seconds(purchase)
    purchase_await_result(purchase=purchase, wait_seconds=max(0.0, wait))
    attempt = PaymentAttempt.objects.get(pk=attempt_id)
    if attempt.state != PaymentAttempt.State.RECORDED:
        return _answer(checkout, claim, purchase, None, fresh=fresh)
    if until is not None:
        # The work took the budget: its settlement still gets a block's wait.
        until = max(until, time.monotonic() + SETTLE_AFTER_WORK_FLOOR_SECONDS)
        checkout = replace(checkout, request=replace(request, settle_wait_until=until))
    return _settle(checkout, claim, purchase, attempt_id, None, fresh=fresh)


# A captured authorization's settlement is given this long after the work however much of
# the request's budget the work used: on a fast chain the block lands within it.
SETTLE_AFTER_WORK_FLOOR_SECONDS = 2.0


def _work_wait_seconds(purchase: Purchase) -> float:
    """No door budget: the offering's expected run time, never past the server-wide cap."""
    return min(
        purchase.offering.expected_run_time.total_seconds(),
        float(settings.X402_RESULT_WAIT_SECONDS),
    )


def _settle(
    checkout: Checkout[A],
    claim: KeyClaim,
    purchase: Purchase,
    attempt_id: int,
    recorded: Recorded | None,
    *,
    fresh: bool,
) -> A | PaymentPending[A]:
    """Settle over the rail and record the outcome, then answer; or return the wait for
    the money when the door sleeps through it itself."""
    request = checkout.request
    sent = purchase_settle_attempt_or_wait(
        attempt_id=attempt_id,
        now=request.now,
        recorded=(recorded.purchase, recorded.attempt, recorded.terms) if recorded else None,
        wait_until=request.settle_wait_until,
    )
    if isinstance(sent, SettlementUnderWay):
        if checkout.returns_wait:
            return PaymentPending(checkout, claim, purchase, sent, fresh)
        sent = settlement_finish(under_way=sent, outcome=sent.receipt.blocking())
    return _answer(checkout, claim, purchase, sent, fresh=fresh)


def _answer(
    checkout: Checkout[A],
    claim: KeyClaim,
    purchase: Purchase,
    settled: Settled | None,
    *,
    fresh: bool,
) -> A:
    """Answer from what the purchase is now (as the settlement left it, or read again when
    it was settled before), and store the answer under the key."""
    if settled is not None:
        answered, attempt = settled.purchase, settled.attempt
    else:
        answered, attempt = purchase_reload(purchase=purchase), None
    stored, sent = checkout.answers.settled(purchase=answered, attempt=attempt, fresh=fresh)
    payment_id_store_answer(claim=claim, answer=stored, purchase=answered, now=checkout.request.now)
    return sent


def _keyed(request: PaymentRequest) -> KeyedRequest:
    presentation = request.presentation
    return KeyedRequest(
        scope=request.scope,
        key=presentation.key,
        principal=presentation.payer,
        fingerprint=request.fingerprint or presentation.fingerprint,
        fingerprint_alias=presentation.fingerprint,
        now=request.now,
        unstored=request.unstored,
    )
