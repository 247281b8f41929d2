"""A chain reorg that undoes a settled, delivered x402 payment (issue 18 item 1).

A real reorg on anvil: a snapshot before the settlement block, the payment settled at depth
1 and its result delivered, more blocks mined, then `evm_revert` to the snapshot and blocks
mined past the old settlement block. The transfer is gone and the authorization's nonce is
unused again. Direct mode (our relayer) and facilitator mode (the facilitator double).

These tests run on the `paused_anvil` session node, which reverts whatever a test did; the
reorg's own snapshot is taken inside that test's, so the node is left as the fixture expects.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from rest_framework.test import APIClient
from x402.http.utils import decode_payment_response_header, decode_payment_signature_header

from devtools.anvil import AnvilNode
from devtools.facilitator_double import FacilitatorDouble
from devtools.test_token import send_transfer_with_authorization
from payments.models import PaymentAttempt
from purchases.models import Escalation, OutboxMessage, Purchase, PurchaseEvent
from purchases.selectors import purchase_capability_url, purchase_status
from purchases.services.fulfil.execution import purchase_execute
from purchases.services.settle import finality
from purchases.services.settle.finality import watch_unfinal_settlements
from purchases.services.shared.alerts import escalation_alert
from tests.fixtures.anvil import closed_port_url
from tests.x402.e2e import PRICE, X402World, ask, build_world, sign_payment

# Also on the embedded SQLite default (the second CI pass): `make demo` serves this.
pytestmark = [pytest.mark.django_db, pytest.mark.embedded]

FINALITY_DEPTH = 4
PAY_ID = "reorg-payment-id-000001"


@pytest.fixture(params=["direct", "facilitator"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _world(mode: str, settings: Any, node: AnvilNode) -> Iterator[X402World]:
    """An automining world on the revertible node, final only FINALITY_DEPTH blocks deep."""
    built = build_world(settings, node, mode=mode)
    built.network_settings.update(finality="depth", finality_depth=FINALITY_DEPTH)
    if mode != "facilitator":
        yield built
        return
    with FacilitatorDouble(node.rpc_url, built.new_account()) as double:
        built.network_settings["facilitator_url"] = double.url
        yield built


@pytest.fixture
def world(mode: str, settings: Any, paused_anvil: AnvilNode, db: None) -> Iterator[X402World]:
    yield from _world(mode, settings, paused_anvil)


@pytest.fixture
def live_world(
    mode: str, settings: Any, paused_anvil: AnvilNode, transactional_db: None
) -> Iterator[X402World]:
    """The same world with committed data, for racing real threads."""
    yield from _world(mode, settings, paused_anvil)


def _paid_and_delivered(world: X402World, client: APIClient, **sign: Any) -> tuple[str, str]:
    """Pay, run the work, resend: 200 with the result and a successful PAYMENT-RESPONSE."""
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID, **sign)
    assert ask(client, world, payment=payment).status_code == 202  # paid, the work queued
    purchase_execute(purchase_id=Purchase.objects.get().pk, worker="test")
    delivered = ask(client, world, payment=payment)
    assert delivered.status_code == 200, delivered.content
    settled = decode_payment_response_header(delivered["PAYMENT-RESPONSE"])
    assert settled.success is True
    assert world.seller_balance() == PRICE
    return payment, settled.transaction.lower()


def _reorg(node: AnvilNode, snapshot: str, *, chain_time: int | None = None) -> None:
    """Undo everything since `snapshot`, then mine past the old settlement block."""
    assert node.rpc("evm_revert", [snapshot]) is True
    # A revert winds the chain clock back to the snapshot: put it where the test wants it.
    node.rpc("anvil_setTime", [chain_time or int(time.time())])
    node.mine(3)


def _subjects(purchase: Purchase) -> list[tuple[str, str]]:
    return [(e.subject, e.reason_code) for e in PurchaseEvent.objects.filter(purchase=purchase)]


def test_a_payment_is_watched_until_final_then_left_alone(world):
    client = APIClient()
    _, tx_hash = _paid_and_delivered(world, client)
    attempt = PaymentAttempt.objects.get()
    assert attempt.final_at is None and attempt.block_number is not None
    assert attempt.next_check_at is not None  # the resend looked, and said when it looks next
    world.node.mine(FINALITY_DEPTH)
    stats = watch_unfinal_settlements(now=datetime.now(UTC) + timedelta(minutes=1))
    assert stats["final"] == 1
    attempt.refresh_from_db()
    assert attempt.final_at is not None and attempt.tx_hash == tx_hash
    purchase = Purchase.objects.get()
    assert ("payment_attempt.final", "") in _subjects(purchase)
    assert "payment_attempt.reorged" not in [s for s, _ in _subjects(purchase)]  # nothing moved
    assert watch_unfinal_settlements(now=datetime.now(UTC) + timedelta(hours=1))["claimed"] == 0


def test_an_unreadable_chain_leaves_it_paid_then_names_an_owner(world):
    _paid_and_delivered(world, APIClient())
    world.network_settings["rpc_url"] = closed_port_url()
    soon = datetime.now(UTC) + timedelta(minutes=1)
    assert watch_unfinal_settlements(now=soon)["unknown"] == 1
    attempt = PaymentAttempt.objects.get()
    assert (attempt.state, attempt.final_at, attempt.unanswered_checks) == ("succeeded", None, 1)
    assert attempt.next_check_at == soon + timedelta(seconds=30)
    assert Purchase.objects.get().payment_state == "paid"  # unknown is not undone
    assert not Escalation.objects.exists()
    past_deadline = soon + timedelta(hours=7)
    assert watch_unfinal_settlements(now=past_deadline)["unknown"] == 1
    escalation = Escalation.objects.get()
    assert (escalation.owner, escalation.reason_code) == (
        "reconciliation",
        "settlement_unresolved_reconciliation",
    )


def test_finalized_policy_waits_for_the_nodes_finalized_block(world):
    # anvil's `finalized` block trails its head by 64; the depth fallback is out of reach.
    world.network_settings.update(finality="finalized", finality_depth=10_000)
    _paid_and_delivered(world, APIClient())
    block = PaymentAttempt.objects.get().block_number
    later = datetime.now(UTC) + timedelta(minutes=1)
    assert watch_unfinal_settlements(now=later)["watching"] == 1
    world.node.mine(64)
    assert watch_unfinal_settlements(now=later + timedelta(minutes=1))["final"] == 1
    final = PurchaseEvent.objects.get(subject="payment_attempt.final")
    assert final.evidence["policy"] == "finalized"
    assert final.evidence["finalized_block"] >= block


def test_reorged_payment_is_settled_again_while_its_window_is_open(world, mode):
    client = APIClient()
    snapshot = world.node.rpc("evm_snapshot")
    payment, vanished = _paid_and_delivered(world, client)
    world.node.mine(1)  # depth 2 of FINALITY_DEPTH: settled, not final
    _reorg(world.node, snapshot)
    assert world.seller_balance() == 0  # the transfer is gone, the nonce unused again

    # Beat's finality watch finds it and settles the same signed authorization again.
    stats = watch_unfinal_settlements(now=datetime.now(UTC) + timedelta(minutes=1))
    assert stats["undone"] == 1
    purchase = Purchase.objects.get()
    attempt = PaymentAttempt.objects.get()
    assert (purchase.payment_state, purchase.fulfillment_state) == ("paid", "succeeded")
    assert attempt.state == "succeeded" and attempt.reorged_at is not None
    assert attempt.final_at is None  # watched again, from its new block
    assert world.seller_balance() == PRICE  # exactly one transfer in the end
    if mode == "direct":
        assert attempt.tx_hash == vanished  # the identical relayer bytes, sent again
    subjects = _subjects(purchase)
    assert ("payment_attempt.reorged", "settlement_reorged") in subjects
    assert ("purchase.payment", "settlement_reorged") in subjects
    assert [s for s, _ in subjects].count("payment_attempt.resubmitted") == 1
    assert not Escalation.objects.exists()

    # The resend names the transaction that holds the money now.
    again = ask(client, world, payment=payment)
    assert again.status_code == 200
    answer = decode_payment_response_header(again["PAYMENT-RESPONSE"])
    assert answer.success is True and answer.transaction.lower() == attempt.tx_hash


def test_a_transfer_that_landed_again_elsewhere_is_followed_not_resubmitted(world):
    """After the reorg someone else broadcasts the same signed authorization first: the
    money is in again, in another transaction; the watch follows it, sends nothing."""
    client = APIClient()
    snapshot = world.node.rpc("evm_snapshot")
    payment, vanished = _paid_and_delivered(world, client)
    _reorg(world.node, snapshot)
    signed = decode_payment_signature_header(payment).payload
    landed = send_transfer_with_authorization(
        world.w3, world.token, world.deployer, signed["authorization"], signed["signature"]
    ).lower()
    # Mined before the watch looks (automine answers the send before the block exists).
    assert world.w3.eth.wait_for_transaction_receipt(landed, timeout=30)["status"] == 1
    assert landed != vanished
    stats = watch_unfinal_settlements(now=datetime.now(UTC) + timedelta(minutes=1))
    assert stats["watching"] == 1
    attempt = PaymentAttempt.objects.get()
    assert (attempt.state, attempt.tx_hash, attempt.reorged_at) == ("succeeded", landed, None)
    moved = PurchaseEvent.objects.get(subject="payment_attempt.reorged")
    assert moved.reason_code == "transfer_moved"
    assert (moved.evidence["was_tx_hash"], moved.evidence["tx_hash"]) == (vanished, landed)
    assert not PurchaseEvent.objects.filter(subject="payment_attempt.resubmitted").exists()
    assert Purchase.objects.get().payment_state == "paid"
    assert world.seller_balance() == PRICE


def test_resend_after_a_reorg_is_pending_until_the_transfer_lands_again(world):
    client = APIClient()
    snapshot = world.node.rpc("evm_snapshot")
    payment, _ = _paid_and_delivered(world, client)
    _reorg(world.node, snapshot)
    world.node.set_automine(False)  # the resubmission waits in the pool

    pending = ask(client, world, payment=payment)
    assert pending.status_code == 202, pending.content
    assert pending["Retry-After"]
    answer = decode_payment_response_header(pending["PAYMENT-RESPONSE"])
    assert answer.success is False
    body = pending.json()
    assert body["status"] == "settlement_pending" and body["owner"] == "reconciliation"
    assert Purchase.objects.get().payment_state == "settlement_pending"
    status_url = APIClient().get(pending["Location"])
    assert status_url.status_code == 202  # the status URL tells the same truth

    world.node.mine(1)
    settled = ask(client, world, payment=payment)
    assert settled.status_code == 200
    assert decode_payment_response_header(settled["PAYMENT-RESPONSE"]).success is True
    assert world.seller_balance() == PRICE
    assert Purchase.objects.get().payment_state == "paid"


def test_reorged_payment_whose_window_closed_is_delivered_payment_reversed(
    world, settings, webhook
):
    settings.TOLLBOOTH_ALERT_WEBHOOK_URL = webhook.url
    client = APIClient()
    valid_before = int(time.time()) + 120
    snapshot = world.node.rpc("evm_snapshot")
    payment, vanished = _paid_and_delivered(world, client, valid_before=valid_before)
    _reorg(world.node, snapshot, chain_time=valid_before + 60)  # the window closed meanwhile

    later = datetime.fromtimestamp(valid_before + 60, UTC)
    stats = watch_unfinal_settlements(now=later)
    assert stats["undone"] == 1
    purchase = Purchase.objects.get()
    assert (purchase.payment_state, purchase.fulfillment_state) == ("reversed", "succeeded")
    assert purchase.reason_code == "payment_reversed"
    attempt = PaymentAttempt.objects.get()
    assert (attempt.state, attempt.reason_code) == ("failed", "authorization_expired_unused")
    assert attempt.tx_hash == vanished  # the vanished transaction stays as evidence
    assert world.seller_balance() == 0
    assert ("payment_attempt.reorged", "settlement_reorged") in _subjects(purchase)
    assert not PurchaseEvent.objects.filter(subject="payment_attempt.resubmitted").exists()

    # An owner, a reason, a deadline, and an alert to a person.
    escalation = Escalation.objects.get()
    assert (escalation.owner, escalation.reason_code) == ("support", "payment_reversed")
    assert escalation.deadline_at > later
    assert escalation.details["tx_hash"] == vanished
    assert OutboxMessage.objects.filter(job="escalation_alert").exists()
    assert escalation_alert(escalation_id=escalation.pk) is True
    [alert] = webhook.received
    assert alert.headers["Idempotency-Key"] == f"tollbooth-escalation-{escalation.pk}"
    assert b"payment_reversed" in alert.body

    # Resends, the status URL and the purchase's status no longer say "paid".
    again = ask(client, world, payment=payment)
    assert again.status_code == 402
    problem = again.json()
    assert (problem["code"], problem["purchase"]) == ("payment_reversed", purchase.ref)
    assert problem["reason"] == "authorization_expired_unused"
    assert problem["retryable"] is False
    by_status_url = APIClient().get(purchase_capability_url(purchase=purchase))
    assert (by_status_url.status_code, by_status_url.json()["code"]) == (402, "payment_reversed")
    status = purchase_status(purchase=Purchase.objects.get(), now=later)
    assert status["payment"]["state"] == "reversed"
    assert (status["settlement"]["state"], status["settlement"]["final"]) == ("failed", False)
    assert (status["next_action"], status["owner"]) == ("wait_for_support", "support")


@pytest.mark.django_db(transaction=True)
def test_a_look_that_saw_it_gone_does_nothing_once_another_settled_it_again(world, monkeypatch):
    """The race the threaded test below meets now and then, in a fixed order: the buyer's
    resend reads the chain (transfer gone), the beat then reopens and settles it again
    (the identical transaction, mined anew) before the resend acts on what it read."""
    snapshot = world.node.rpc("evm_snapshot")
    payment, _ = _paid_and_delivered(world, APIClient())
    _reorg(world.node, snapshot)
    real_look = finality.settlement_finality

    def look_then_let_the_beat_act_first(**kwargs: Any) -> Any:
        check = real_look(**kwargs)
        assert check.finality == finality.Finality.UNDONE
        monkeypatch.setattr(finality, "settlement_finality", real_look)
        assert watch_unfinal_settlements(now=datetime.now(UTC) + timedelta(minutes=1))["undone"]
        return check

    monkeypatch.setattr(finality, "settlement_finality", look_then_let_the_beat_act_first)
    assert ask(APIClient(), world, payment=payment).status_code == 200
    subjects = _subjects(Purchase.objects.get())
    assert subjects.count(("payment_attempt.reorged", "settlement_reorged")) == 1
    assert [s for s, _ in subjects].count("payment_attempt.resubmitted") == 1
    assert world.seller_balance() == PRICE
    assert (Purchase.objects.get().payment_state, PaymentAttempt.objects.get().state) == (
        "paid",
        "succeeded",
    )


def test_beat_and_buyers_racing_on_a_reorg_settle_it_again_once(live_world):
    """The beat's watch and two resends find the same vanished transfer at once: one
    reopening, one resubmission, one transfer in the end, and nobody is told it failed."""
    world = live_world
    snapshot = world.node.rpc("evm_snapshot")
    payment, _ = _paid_and_delivered(world, APIClient())
    _reorg(world.node, snapshot)
    barrier = threading.Barrier(3)
    answers: list[int] = []

    def resend() -> None:
        try:
            barrier.wait()
            answers.append(ask(APIClient(), world, payment=payment).status_code)
        finally:
            connection.close()

    def beat() -> None:
        try:
            barrier.wait()
            watch_unfinal_settlements(now=datetime.now(UTC) + timedelta(minutes=1))
        finally:
            connection.close()

    threads = [threading.Thread(target=fn) for fn in (resend, resend, beat)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(answers) == 2 and set(answers) <= {200, 202}, answers
    assert world.seller_balance() == PRICE
    purchase = Purchase.objects.get()
    subjects = _subjects(purchase)
    assert subjects.count(("payment_attempt.reorged", "settlement_reorged")) == 1
    assert [s for s, _ in subjects].count("payment_attempt.resubmitted") == 1
    assert Purchase.objects.get().payment_state == "paid"
    assert PaymentAttempt.objects.get().state == "succeeded"
