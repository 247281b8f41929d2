"""The authorization flow (issue 34 part 1): verify and hold, run the work, settle after.

Balances are read on the anvil chain. A held authorization is never broadcast by anything
but its work's terminal move; a provably failed run is never settled; the result is released
only once the settlement is confirmed; a run whose settlement was interrupted resumes at the
settlement with the same authorization and settles once.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient
from x402.http.utils import decode_payment_required_header

from devtools.test_token import cancel_authorization
from fulfillment.models import Result
from payments.chain.token import authorization_state, balance_of
from payments.models import PaymentAttempt, Refund
from purchases.models import Escalation, OutboxMessage, Purchase, PurchaseEvent
from purchases.services.fulfil.execution import ExecutionOutcome, purchase_execute
from purchases.services.jobs.reconcile import reconcile_pending_settlements
from purchases.services.settle.authorization import authorizations_held_sweep
from purchases.services.settle.settlement import purchase_settle_attempt
from tests.fixtures.anvil import erc20_transfer
from tests.x402.e2e import FUNDED, PRICE, X402World, ask, sign_payment

pytestmark = pytest.mark.embedded
PAY_ID = "x402-authflow-id-000001"
AUTHORIZATION = {"delivery_condition": "authorization"}


def _payer_balance(world: X402World) -> int:
    return balance_of(world.w3, world.token, world.payers[0].address)


def _accepts(response) -> dict:
    required = decode_payment_required_header(response["PAYMENT-REQUIRED"])
    return required.accepts[0].model_dump(by_alias=True)


def test_an_upfront_offering_says_so_and_an_authorization_one_writes_nothing(
    make_x402_world, db, settings
):
    upfront = make_x402_world()
    client = APIClient()
    assert _accepts(ask(client, upfront))["extra"]["paymentFlow"] == "upfront"

    held = make_x402_world(offering=AUTHORIZATION)
    accepts = _accepts(ask(client, held))
    assert "paymentFlow" not in accepts["extra"]  # the wire default, never written
    # The work's deadline (2 h by default) + the settle margin + the confirmation timeout,
    # capped by the window setting.
    assert accepts["maxTimeoutSeconds"] == 3600
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "EXECUTION_DEADLINE": timedelta(seconds=60)}
    assert _accepts(ask(client, held))["maxTimeoutSeconds"] == 60 + 120 + 2


def test_a_successful_run_is_charged_once_and_released_only_after_its_settlement(
    make_x402_world, db, settings
):
    world = make_x402_world(offering=AUTHORIZATION)
    settings.X402_RESULT_WAIT_SECONDS = 30  # the in-process work runs inside the request
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    delivered = ask(client, world, payment=payment)
    assert delivered.status_code == 200, delivered.content
    assert delivered.json()["title"] == "Sales"
    purchase = Purchase.objects.get()
    attempt = PaymentAttempt.objects.get()
    assert (purchase.payment_state, purchase.fulfillment_state) == ("paid", "succeeded")
    assert attempt.state == "succeeded" and attempt.tx_hash
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1
    assert _payer_balance(world) == FUNDED - PRICE
    # The order on the timeline: held, work stored and captured, then paid, then delivered.
    subjects = [
        (e.subject, e.to_state, e.reason_code)
        for e in PurchaseEvent.objects.filter(purchase=purchase).order_by("created_at", "pk")
    ]
    held = subjects.index(("payment_attempt", "held", "authorization_held"))
    captured = subjects.index(("payment_attempt", "recorded", "work_succeeded"))
    paid = subjects.index(("purchase.payment", "paid", ""))
    delivered_at = [i for i, s in enumerate(subjects) if s[0] == "result.delivered"]
    assert held < captured < paid < delivered_at[0], subjects

    again = ask(client, world, payment=payment)  # the same header: the same purchase
    assert again.status_code == 200 and world.relayer_sent() == 1


def test_a_held_attempt_is_never_broadcast_by_the_sweeps(make_x402_world, db, settings):
    world = make_x402_world(offering=AUTHORIZATION)
    client = APIClient()  # no inline run (no wait budget): the work waits for a worker
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    pending = ask(client, world, payment=payment)
    assert pending.status_code == 202, pending.content
    attempt = PaymentAttempt.objects.get()
    assert attempt.state == "held" and Purchase.objects.get().payment_state == "authorized"

    later = timezone.now() + timedelta(minutes=5)  # past every grace, inside the window
    reconcile_pending_settlements(now=later)
    assert purchase_settle_attempt(attempt_id=attempt.pk, now=later) is None
    assert ask(client, world, payment=payment).status_code == 202  # the buyer's resend
    assert authorizations_held_sweep(now=later)["captured"] == 0  # work not ended, margin far
    attempt.refresh_from_db()
    assert attempt.state == "held" and attempt.broadcast_started_at is None
    assert world.relayer_sent() == 0 and world.seller_balance() == 0


def test_a_run_whose_settlement_was_interrupted_resumes_and_settles_once(
    make_x402_world, db, settings
):
    """The worker ran the work (its terminal move captured the authorization and staged its
    settlement) and nobody settled it: the staged job, then the buyer's resend, settle the
    same authorization exactly once and the result is released then."""
    world = make_x402_world(offering=AUTHORIZATION)
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    assert ask(client, world, payment=payment).status_code == 202
    purchase = Purchase.objects.get()
    assert purchase_execute(purchase_id=purchase.pk, worker="w1") == ExecutionOutcome.SUCCEEDED
    purchase.refresh_from_db()
    attempt = PaymentAttempt.objects.get()
    assert (purchase.payment_state, attempt.state) == ("paying", "recorded")
    assert Result.objects.filter(purchase=purchase).exists()
    staged = OutboxMessage.objects.get(job="payment_settle_captured")
    assert staged.kwargs == {"attempt_id": attempt.pk}
    assert world.relayer_sent() == 0  # nothing broadcast yet: the process "died" here

    # Not released before the money: the capability URL's view says settling.
    assert purchase_settle_attempt(attempt_id=attempt.pk) is not None  # the staged job
    assert purchase_settle_attempt(attempt_id=attempt.pk) is None  # its redelivery
    delivered = ask(client, world, payment=payment)
    assert delivered.status_code == 200 and delivered.json()["title"] == "Sales"
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1
    assert Purchase.objects.get().payment_state == "paid"


def test_the_held_sweep_settles_an_unfinished_run_at_its_margin(make_x402_world, db, settings):
    world = make_x402_world(offering=AUTHORIZATION)
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    assert ask(client, world, payment=payment).status_code == 202
    attempt = PaymentAttempt.objects.get()
    near = attempt.valid_before_at - settings.TOLLBOOTH["AUTHORIZATION_SETTLE_MARGIN"]
    assert authorizations_held_sweep(now=near)["captured"] == 1
    attempt.refresh_from_db()
    assert attempt.state == "recorded"
    assert purchase_settle_attempt(attempt_id=attempt.pk) is not None
    assert world.seller_balance() == PRICE and world.relayer_sent() == 1
    assert Purchase.objects.get().payment_state == "paid"


def test_a_settlement_that_cannot_land_after_the_work_escalates_work_done_unpaid(
    make_x402_world, db, settings
):
    """The work ran, then its authorization could no longer land (here its window closed
    before the settlement: a worker down that long): the work is done, the money never
    comes; support is told under a reason that is counted, and nothing is refunded."""
    world = make_x402_world(no_mining=True, offering=AUTHORIZATION)
    world.node.set_automine(True)
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    assert ask(client, world, payment=payment).status_code == 202
    purchase = Purchase.objects.get()
    assert purchase_execute(purchase_id=purchase.pk, worker="w1") == ExecutionOutcome.SUCCEEDED
    attempt = PaymentAttempt.objects.get()
    world.node.increase_time(3600)
    world.node.mine()
    purchase_settle_attempt(attempt_id=attempt.pk, now=attempt.valid_before_at + timedelta(hours=1))
    purchase.refresh_from_db()
    assert purchase.payment_state == "failed" and purchase.fulfillment_state == "succeeded"
    escalation = Escalation.objects.get(purchase=purchase, reason_code="work_done_unpaid")
    assert escalation.owner == "support"
    assert world.seller_balance() == 0 and _payer_balance(world) == FUNDED
    assert not Refund.objects.exists()


def test_a_payer_drained_before_the_work_runs_gets_no_work_and_no_charge(
    make_x402_world, db, settings
):
    """The balance and authorizationState are read again just before the work starts: a
    payer who moved its funds away after the 402 gets nothing run and nothing charged."""
    world = make_x402_world(offering=AUTHORIZATION)
    client = APIClient()
    payer = world.payers[0]
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], payer, PAY_ID)
    assert ask(client, world, payment=payment).status_code == 202
    erc20_transfer(world.w3, world.token, payer, world.deployer.address, FUNDED)
    purchase = Purchase.objects.get()
    assert purchase_execute(purchase_id=purchase.pk, worker="w1") == ExecutionOutcome.FAILED
    purchase.refresh_from_db()
    assert (purchase.payment_state, purchase.fulfillment_state) == ("released", "failed")
    assert purchase.reason_code == "insufficient_balance"
    assert not Result.objects.filter(purchase=purchase).exists()
    answer = ask(client, world, payment=payment)  # the buyer's resend is told, not charged
    assert answer.status_code == 409 and answer.json()["charged"] is False
    assert world.relayer_sent() == 0 and world.seller_balance() == 0
    assert not Refund.objects.exists()


def test_the_buyer_cancelling_while_the_work_runs_is_work_done_unpaid(
    make_x402_world, db, settings
):
    """The bounded risk of the flow: the buyer cancels its authorization on chain after the
    pre-work check (cancelAuthorization, as real USDC has). The work is done; the settlement
    cannot land; the purchase is failed with its work succeeded, escalated to support under
    `work_done_unpaid`, and nothing moved."""
    world = make_x402_world(offering=AUTHORIZATION)
    client = APIClient()
    payer = world.payers[0]
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], payer, PAY_ID)
    assert ask(client, world, payment=payment).status_code == 202
    purchase = Purchase.objects.get()
    assert purchase_execute(purchase_id=purchase.pk, worker="w1") == ExecutionOutcome.SUCCEEDED
    attempt = PaymentAttempt.objects.get()
    cancel_authorization(world.w3, world.token, payer, attempt.authorization_nonce)
    assert authorization_state(world.w3, world.token, payer.address, attempt.authorization_nonce)

    purchase_settle_attempt(attempt_id=attempt.pk)
    purchase.refresh_from_db()
    assert (purchase.payment_state, purchase.fulfillment_state) == ("failed", "succeeded")
    assert Escalation.objects.filter(purchase=purchase, reason_code="work_done_unpaid").count() == 1
    assert _payer_balance(world) == FUNDED and world.seller_balance() == 0
    delivered = ask(client, world, payment=payment)  # never released unpaid
    assert delivered.status_code != 200


def test_a_re_signed_retry_while_the_work_runs_gets_the_same_purchase(
    make_x402_world, db, settings
):
    world = make_x402_world(offering=AUTHORIZATION)
    client = APIClient()
    first = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], None)
    assert ask(client, world, payment=first).status_code == 202
    purchase = Purchase.objects.get()
    # The stock clients re-sign on retry: a new nonce against a new 402, same input.
    again = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], None)
    retry = ask(client, world, payment=again)
    assert retry.status_code == 202, retry.content
    assert retry["Tollbooth-Duplicate-Of"] == purchase.ref
    assert Purchase.objects.count() == 1 and PaymentAttempt.objects.count() == 1
    assert PaymentAttempt.objects.get().state == "held" and world.relayer_sent() == 0
