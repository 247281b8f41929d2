"""Recovery that does not wait for a clock (issue 18 items 3, 6 and 13): a relayer nonce gap
left by a lost broadcast is closed before the next buyer's broadcast, the first resubmission
of a payment a facilitator never broadcast goes out on the buyer's next retry, and a
facilitator's HTTP 500 `settlement_pending` is named for what it says.

Real anvil chain, real HTTP facilitator double; no clock is moved unless a test says so.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from devtools.facilitator_double import FacilitatorDouble
from payments.models import PaymentAttempt
from payments.rails.x402.direct import relayer_signer_for
from purchases.models import JobRun, Purchase, PurchaseEvent
from purchases.services.jobs.reconcile import reconcile_pending_settlements
from purchases.services.settle.resubmit import BACKOFF
from tests.x402.e2e import PRICE, X402World, ask, sign_payment

pytestmark = pytest.mark.embedded

RESUBMITTED = "payment_attempt.resubmitted"
BROADCAST = "payment_attempt.broadcast"
ANSWERED = "facilitator.answered"
GAP_CLOSED = "payment_attempt.relayer_gap_closed"
DUPLICATE_OF = "Tollbooth-Duplicate-Of"
# The wall-clock time this machine may take between a test stamping a backoff's start and
# the request checking it: the backoff is proven not due this much before it ends.
MARGIN = timedelta(seconds=5)


def _first_payment(world: X402World, client: APIClient, payment_id: str | None) -> str:
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], payment_id)
    first = ask(client, world, payment=payment)
    assert first.status_code == 202, first.content
    assert first.json()["status"] == "settlement_pending"
    return payment


def _retry(world: X402World, client: APIClient, payment: str, how: str) -> Any:
    """The buyer's retry: the same PAYMENT-SIGNATURE, or (a stock client) a new signature
    for the same input inside the duplicate window, which is answered as the same purchase."""
    if how == "resend":
        return ask(client, world, payment=payment)
    again = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], None)
    answer = ask(client, world, payment=again)
    assert answer[DUPLICATE_OF] == Purchase.objects.get().ref
    return answer


def _signed_payloads(double: FacilitatorDouble) -> set[str]:
    return {body["paymentPayload"]["payload"]["signature"] for body in double.bodies["settle"]}


@pytest.mark.parametrize("how", ["resend", "re-sign"])
def test_the_first_resubmission_goes_out_on_the_buyers_next_retry_not_30_s_later(
    make_facilitated_world, db, how
):
    world, double = make_facilitated_world(mode="invalid_transaction_state")
    client = APIClient()
    payment = _first_payment(world, client, "prompt-resubmit-0001" if how == "resend" else None)
    assert double.calls["settle"] == 1 and double.broadcast_count == 0
    double.mode = "ok"  # the facilitator would broadcast now

    retried = _retry(world, client, payment, how)  # at once: no clock moved

    assert retried.json()["payment"]["state"] == "paid", retried.content
    assert double.calls["settle"] == 2 and double.broadcast_count == 1
    assert world.seller_balance() == PRICE
    assert len(_signed_payloads(double)) == 1  # the first authorization, never a new one
    attempt = PaymentAttempt.objects.get()
    assert (attempt.state, attempt.resubmissions) == ("succeeded", 1)
    assert attempt.resubmitted_at is not None and attempt.broadcast_started_at is not None
    assert attempt.resubmitted_at - attempt.broadcast_started_at < timedelta(seconds=30)
    [event] = PurchaseEvent.objects.filter(subject=RESUBMITTED)
    assert (event.evidence["try"], event.evidence["answer"]["status"]) == (1, "confirmed")


def test_only_the_first_resubmission_skips_the_backoff(make_facilitated_world, db):
    world, double = make_facilitated_world(mode="invalid_transaction_state")
    client = APIClient()
    payment = _first_payment(world, client, "prompt-resubmit-0002")

    ask(client, world, payment=payment)  # try 1, at once; still refused
    ask(client, world, payment=payment)  # try 2 waits its 2 minutes
    assert double.calls["settle"] == 2
    # Try 1 stamped as 2 minutes ago less MARGIN, from now (not from its own stamp, which the
    # rest of its request already aged by a second or more on a loaded machine).
    PaymentAttempt.objects.update(resubmitted_at=timezone.now() - BACKOFF[1] + MARGIN)
    ask(client, world, payment=payment)
    assert double.calls["settle"] == 2
    PaymentAttempt.objects.update(resubmitted_at=timezone.now() - BACKOFF[1] - timedelta(seconds=1))
    double.mode = "ok"
    paid = ask(client, world, payment=payment)

    assert paid.json()["payment"]["state"] == "paid"
    assert double.calls["settle"] == 3 and double.broadcast_count == 1
    assert PaymentAttempt.objects.get().resubmissions == 2
    assert world.seller_balance() == PRICE


def test_a_first_submission_that_may_still_be_running_keeps_its_backoff(make_facilitated_world, db):
    """A request that died after claiming the first broadcast leaves the attempt `recorded`:
    its /settle may still be on its way, so nothing is sent beside it for 30 s."""
    from purchases.services.settle.resubmit import payment_resubmit_next_at

    world, _ = make_facilitated_world(mode="invalid_transaction_state")
    _first_payment(world, APIClient(), "prompt-resubmit-0003")
    answered = PaymentAttempt.objects.get()
    assert payment_resubmit_next_at(attempt=answered) == answered.broadcast_started_at
    in_flight = PaymentAttempt(
        state=PaymentAttempt.State.RECORDED, broadcast_started_at=answered.broadcast_started_at
    )
    assert payment_resubmit_next_at(attempt=in_flight) == answered.broadcast_started_at + (
        timedelta(seconds=30)
    )


def test_a_facilitators_http_500_settlement_pending_is_labelled_pending_with_its_hash(
    make_facilitated_world, db
):
    world, double = make_facilitated_world(mode="settlement_pending_500")
    client = APIClient()
    payment = _first_payment(world, client, "cdp-pending-000001")

    [tx_hash] = double.broadcasts
    attempt = PaymentAttempt.objects.get()
    assert (attempt.state, attempt.reason_code) == ("settlement_pending", "settlement_pending")
    assert attempt.tx_hash == tx_hash.lower()
    assert Purchase.objects.get().reason_code == "settlement_pending"
    [broadcast] = PurchaseEvent.objects.filter(subject=BROADCAST)
    assert broadcast.reason_code == "settlement_pending"
    assert broadcast.evidence["tx_hash"] == tx_hash
    settle = PurchaseEvent.objects.get(subject=ANSWERED, reason_code="settle")
    assert (settle.evidence["http_status"], settle.evidence["success"]) == (500, False)
    assert settle.evidence["error_reason"] == "settlement_pending"
    assert settle.evidence["transaction"] == tx_hash
    assert not PurchaseEvent.objects.filter(reason_code="facilitator_bad_response").exists()

    paid = ask(client, world, payment=payment)  # the named hash is reconciled, not resent
    assert paid.json()["payment"]["state"] == "paid"
    assert double.calls["settle"] == 1 and world.seller_balance() == PRICE


# --- a relayer nonce gap (item 3) ---------------------------------------------------------

OTHER_INPUT = {"title": "Another report", "csv": "region,units\nsouth,5\n"}


def _next_buyer_pays(world: X402World, client: APIClient) -> Any:
    """Another buyer, another input, on a chain that mines as it receives."""
    required = ask(client, world, OTHER_INPUT)["PAYMENT-REQUIRED"]
    payment = sign_payment(required, world.payers[1], "gap-next-buyer-0001")
    return ask(client, world, OTHER_INPUT, payment=payment)


def _gap_closed_before(purchase: Purchase) -> list[dict[str, Any]]:
    broadcast = PurchaseEvent.objects.get(purchase=purchase, subject=BROADCAST)
    closed: list[dict[str, Any]] = broadcast.evidence.get("relayer_gap_closed", [])
    return closed


@pytest.mark.parametrize("window", ["open", "closed", "closed_and_failed"])
def test_after_a_dropped_broadcast_the_next_purchase_settles_in_its_own_request(
    make_x402_world, db, window
):
    world = make_x402_world(no_mining=True)
    client = APIClient()
    valid_before = int(time.time()) + 35  # the shortest window the seller accepts
    required = ask(client, world)["PAYMENT-REQUIRED"]
    lost_payment = sign_payment(required, world.payers[0], "gap-lost-buyer-0001",
                                valid_before=valid_before)  # fmt: skip
    assert ask(client, world, payment=lost_payment).status_code == 202
    lost = PaymentAttempt.objects.get()
    world.node.drop_transaction(lost.tx_hash)  # the node loses it: its nonce is a gap now
    if window != "open":  # the authorization-expired situation: it can never execute
        world.node.set_next_block_timestamp(valid_before + 1)
        world.node.mine()
    if window == "closed_and_failed":  # and reconciliation has failed it for good since
        reconcile_pending_settlements(now=timezone.now() + timedelta(minutes=3))
        lost.refresh_from_db()
        assert (lost.state, lost.reason_code) == ("failed", "authorization_expired_unused")
    world.node.set_automine(True)

    answer = _next_buyer_pays(world, client)

    assert answer.json()["payment"]["state"] == "paid", answer.content  # in this request
    assert not JobRun.objects.filter(job="heal_relayers").exists()
    purchase = Purchase.objects.exclude(pk=lost.purchase_id).get()
    attempt = purchase.payment_attempts.get()
    assert (attempt.state, attempt.relayer_nonce) == ("succeeded", lost.relayer_nonce + 1)
    [closed] = _gap_closed_before(purchase)
    assert (closed["relayer_nonce"], closed["attempts"]) == (lost.relayer_nonce, [lost.pk])
    # The lost payment's own timeline says what became of its transaction, and why.
    [note] = PurchaseEvent.objects.filter(purchase_id=lost.purchase_id, subject=GAP_CLOSED)
    assert note.reason_code == closed["action"]
    assert note.evidence == {
        "attempt": lost.pk,
        "mode": "direct",
        "payer": lost.payer,
        "nonce": lost.authorization_nonce,
        "tx_hash": lost.tx_hash,
        "relayer_nonce": lost.relayer_nonce,
        "sent_tx_hash": closed["tx_hash"],
        "before_purchase": purchase.ref,
    }
    latest = world.w3.eth.get_transaction_count(world.relayer.address, "latest")
    assert latest == lost.relayer_nonce + 2  # the gap and the new one, both mined
    if window == "open":  # the lost transaction itself, byte for byte: its buyer is paid too
        assert (closed["action"], closed["tx_hash"]) == ("rebroadcast", lost.tx_hash)
        assert world.seller_balance() == 2 * PRICE
        again = ask(client, world, payment=lost_payment)
        assert again.json()["payment"]["state"] == "paid"
    else:  # it can no longer execute: a 0-value self-transfer holds its nonce instead
        assert closed["action"] == "gap_filled" and closed["tx_hash"] != lost.tx_hash
        filler = world.w3.eth.get_transaction(closed["tx_hash"])
        assert (filler["to"], filler["value"]) == (world.relayer.address, 0)
        assert world.seller_balance() == PRICE  # the expired authorization moved nothing


def test_after_a_reorg_undid_our_transaction_the_next_purchase_settles_at_once(make_x402_world, db):
    # The node this test may revert (paused_anvil, reverted after it): a revert on the
    # session's shared node winds its clock back under every later test.
    world = make_x402_world(no_mining=True)
    world.node.set_automine(True)  # mining as it receives
    client = APIClient()
    snapshot = world.node.rpc("evm_snapshot")
    required = ask(client, world)["PAYMENT-REQUIRED"]
    first_payment = sign_payment(required, world.payers[0], "gap-reorg-buyer-001")
    first = ask(client, world, payment=first_payment)
    assert first.json()["payment"]["state"] == "paid"
    undone = PaymentAttempt.objects.get()
    world.node.rpc("evm_revert", [snapshot])  # the block holding it is gone, and the tx
    assert world.w3.eth.get_transaction_count(world.relayer.address, "pending") == (
        undone.relayer_nonce
    )

    answer = _next_buyer_pays(world, client)

    assert answer.json()["payment"]["state"] == "paid", answer.content
    purchase = Purchase.objects.exclude(pk=undone.purchase_id).get()
    assert _gap_closed_before(purchase) == [
        {
            "relayer_nonce": undone.relayer_nonce,
            "action": "rebroadcast",
            "tx_hash": undone.tx_hash,
            "attempts": [undone.pk],
        }
    ]
    assert world.seller_balance() == 2 * PRICE  # the undone transfer landed again, once
    assert not JobRun.objects.filter(job="heal_relayers").exists()


def test_a_nonce_whose_own_send_may_still_be_on_its_way_is_not_touched(make_x402_world, db):
    """Concurrent settlements pipeline: a nonce handed out just before ours, recorded and not
    yet sent, is that settlement's to send. Nothing is sent or filled in its place."""
    from payments.rails.x402.networks import network_config
    from payments.rails.x402.relayer import relayer_gap_close

    world = make_x402_world(no_mining=True)
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], None)
    assert ask(client, world, payment=payment).status_code == 202
    world.node.drop_transaction(PaymentAttempt.objects.get().tx_hash)
    PaymentAttempt.objects.update(state="recorded")  # as if its first send were under way
    network = network_config("eip155:31337")
    account = relayer_signer_for(network)

    assert relayer_gap_close(network=network, account=account, chain_pending=0, allocated=1) == []
    assert world.w3.eth.get_transaction_count(world.relayer.address, "pending") == 0


def test_a_gap_check_reads_only_its_own_keys_transactions_at_those_nonces(make_x402_world, db):
    """After a key rotation (and in the bench, a new chain and key per window) an earlier
    key's transactions sit at the same nonce numbers: the gap check does not even read or
    decode them (their signer recovery grew the paid call's CPU with every earlier key); a
    row recorded before the relayer's address was kept is still read and told apart."""
    from payments.rails.x402.networks import network_config
    from payments.rails.x402.relayer import _signer_and_nonce, relayer_gap_close

    world = make_x402_world(no_mining=True)
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], None)
    assert ask(client, world, payment=payment).status_code == 202
    lost = PaymentAttempt.objects.get()
    assert (lost.relayer_nonce, lost.relayer_address) == (0, world.relayer.address)
    world.node.drop_transaction(lost.tx_hash)  # nonce 0 is a gap now
    network = network_config("eip155:31337")
    earlier_key = world.new_account().address

    def gap_close() -> list[Any]:
        _signer_and_nonce.cache_clear()
        return relayer_gap_close(
            network=network,
            account=relayer_signer_for(network),
            chain_pending=0,
            allocated=1,
            lapsed_below=0,
        )

    PaymentAttempt.objects.update(relayer_address=earlier_key)  # as if signed by that key
    assert gap_close() == []
    assert _signer_and_nonce.cache_info().misses == 0  # its row was never read
    PaymentAttempt.objects.update(relayer_address="")  # recorded before the column
    [resent] = gap_close()
    assert (resent["action"], resent["tx_hash"]) == ("rebroadcast", lost.tx_hash)
    assert _signer_and_nonce.cache_info().misses == 1


def test_a_lost_transaction_of_a_payment_recorded_as_failed_is_filled_never_sent_again(
    make_x402_world, db
):
    """Its authorization could still execute, yet the purchase was told it is not paid: our
    relayer must not move that money now. Its nonce gets a self-transfer instead."""
    world = make_x402_world(no_mining=True)
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], None)
    assert ask(client, world, payment=payment).status_code == 202
    lost = PaymentAttempt.objects.get()
    world.node.drop_transaction(lost.tx_hash)
    PaymentAttempt.objects.update(state="failed")  # recorded as failed, whatever the reason
    world.node.set_automine(True)

    answer = _next_buyer_pays(world, client)

    assert answer.json()["payment"]["state"] == "paid", answer.content
    purchase = Purchase.objects.exclude(pk=lost.purchase_id).get()
    [closed] = _gap_closed_before(purchase)
    assert (closed["relayer_nonce"], closed["action"]) == (lost.relayer_nonce, "gap_filled")
    assert world.seller_balance() == PRICE  # only the new buyer's
