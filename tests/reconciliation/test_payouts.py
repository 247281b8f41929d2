"""Refunds paid out from the refund wallet (issue 21 §2), on the local anvil chain.

Each payout is signed and recorded before anything is sent, broadcast after the commit,
reconciled like a settlement: a dropped broadcast is re-sent byte for byte (never a second
transfer), pending says what it awaits, failure needs proof, and the refund closes on the
same checks as a hand payback once the transfer is final. Balances are read from the token.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from eth_account import Account
from eth_typing import HexStr
from eth_utils import keccak
from hexbytes import HexBytes

from core.actors import Actor
from core.errors import ErrorCode
from devtools.test_token import mint
from payments.models import Payout, Refund
from payments.paybacks import RefundPaybackRefused
from purchases.models import OutboxMessage, PurchaseEvent
from purchases.services.remedy.paybacks import purchase_refund_payback_close
from purchases.services.remedy.payout_reconcile import payout_broadcast, payouts_reconcile
from purchases.services.remedy.payouts import (
    PayoutRefused,
    payout_cancel,
    payout_second_approve,
    refund_payout_approve,
    refunds_payout_approve,
)
from tests.fixtures.anvil import erc20_transfer
from tests.reconciliation.payout_world import FINALITY_DEPTH, PayoutWorld, add_refund_wallet
from tests.x402.e2e import PRICE, X402World

FAY = Actor.staff("fay-finance")
GUS = Actor.staff("gus-finance")


@pytest.fixture
def payouts(x402_world: X402World, settings: Any) -> PayoutWorld:
    return add_refund_wallet(x402_world, settings)


@pytest.fixture
def paused_payouts(x402_paused_world: X402World, settings: Any) -> PayoutWorld:
    x402_paused_world.node.set_automine(True)  # fund the wallet, then pause again
    world = add_refund_wallet(x402_paused_world, settings)
    x402_paused_world.node.set_automine(False)
    return world


def later(minutes: int = 1) -> Any:
    return timezone.now() + timedelta(minutes=minutes)


@pytest.mark.django_db
def test_a_batch_is_recorded_before_its_broadcast_then_paid_and_closed_once_final(
    payouts: PayoutWorld,
) -> None:
    world = payouts.world
    payer, other = world.payers[0], world.payers[1]
    first, second = payouts.owed_refund(payer), payouts.owed_refund(other, amount=PRICE // 2)
    before = (payouts.balance(payer.address), payouts.balance(other.address))

    batch = refunds_payout_approve(refund_ids=[first.pk, second.pk], actor=FAY)

    assert batch.refused == {}
    recorded = list(Payout.objects.order_by("pk"))
    assert [p.state for p in recorded] == ["recorded", "recorded"]
    # Signed and recorded, nothing sent: its hash is the hash of the recorded bytes.
    for payout, nonce in zip(recorded, (0, 1), strict=True):
        assert payout.nonce == nonce and payout.from_address == payouts.wallet.address.lower()
        assert payout.tx_hash == HexBytes(keccak(HexBytes(payout.raw_transaction))).to_0x_hex()
        assert Account.recover_transaction(payout.raw_transaction) == payouts.wallet.address
        assert payout.awaiting == "broadcast" and payout.next_check_at is not None
    assert [p.destination.lower() for p in recorded] == [
        payer.address.lower(),
        other.address.lower(),
    ]
    assert payouts.wallet_sent() == 0
    staged = OutboxMessage.objects.filter(job="payout_broadcast")
    assert sorted(m.kwargs["payout_id"] for m in staged) == [p.pk for p in recorded]
    assert PurchaseEvent.objects.filter(subject="payout", to_state="recorded").count() == 2

    assert [payout_broadcast(payout_id=p.pk) for p in recorded] == ["sent", "sent"]
    # Mined at once (automine), one block each: not three deep yet, pending finality.
    stats = payouts_reconcile(now=later())
    assert stats["pending:finality"] == 2
    last = Payout.objects.get(refund=second)
    assert last.state == "broadcast" and last.awaiting == "finality"
    assert (last.evidence["depth"], last.evidence["finality_depth"]) == (1, 3)
    first.refresh_from_db()
    assert first.state == "owed"

    world.node.mine(FINALITY_DEPTH - 1)
    assert payouts_reconcile(now=later(2))["confirmed"] == 2
    for refund, payout in ((first, recorded[0]), (second, recorded[1])):
        refund.refresh_from_db()
        payout.refresh_from_db()
        assert payout.state == "confirmed" and payout.block_number is not None
        # Closed through the payback checks: its paid reference is the payout's transaction.
        assert (refund.state, refund.paid_reference) == ("paid", payout.tx_hash)
        assert refund.payback_code == "payback_closes"
        assert refund.paid_by == f"payout {payout.pk} (fay-finance)"
    after = (payouts.balance(payer.address), payouts.balance(other.address))
    assert (after[0] - before[0], after[1] - before[1]) == (PRICE, PRICE // 2)
    assert payouts.balance(payouts.wallet.address) == 100 * PRICE - PRICE - PRICE // 2
    assert payouts.wallet_sent() == 2
    # Nothing left to do: the job looks at nothing, and an approval again is refused.
    assert payouts_reconcile(now=later(3)) == {}
    with pytest.raises(PayoutRefused) as refused:
        refund_payout_approve(refund_id=first.pk, actor=FAY)
    assert refused.value.code == ErrorCode.PAYOUT_NOT_PAYABLE


@pytest.mark.django_db
def test_a_dropped_broadcast_is_resent_byte_for_byte_and_pays_once(
    paused_payouts: PayoutWorld,
) -> None:
    world = paused_payouts.world
    payer = world.payers[0]
    refund = paused_payouts.owed_refund(payer)
    before = paused_payouts.balance(payer.address)
    payout = refund_payout_approve(refund_id=refund.pk, actor=FAY)
    assert payout_broadcast(payout_id=payout.pk) == "sent"
    assert world.w3.eth.get_transaction(HexStr(str(payout.tx_hash)))  # in the pool

    # Still in the pool: pending, awaiting inclusion, with its next check.
    now = later()
    assert payouts_reconcile(now=now) == {"pending:inclusion": 1}
    payout.refresh_from_db()
    assert (payout.awaiting, payout.next_check_at) == ("inclusion", now + timedelta(seconds=30))

    world.node.rpc("anvil_dropTransaction", [payout.tx_hash])
    assert payouts_reconcile(now=later(2)) == {"resent": 1}
    payout.refresh_from_db()
    assert payout.broadcasts == 2
    # The very same transaction is back in the pool (same hash, same nonce).
    assert world.w3.eth.get_transaction(HexStr(str(payout.tx_hash)))["nonce"] == 0
    event = PurchaseEvent.objects.get(subject="payout.rebroadcast")
    assert (event.reason_code, event.evidence["tx_hash"]) == ("payout_send_sent", payout.tx_hash)

    world.node.mine(FINALITY_DEPTH)
    assert payouts_reconcile(now=later(3)) == {"confirmed": 1}
    refund.refresh_from_db()
    assert (refund.state, refund.paid_reference) == ("paid", payout.tx_hash)
    assert paused_payouts.balance(payer.address) - before == PRICE
    assert paused_payouts.wallet_sent() == 1


@pytest.mark.django_db
def test_a_broadcast_the_node_refuses_stays_recorded_and_is_sent_when_it_can_be(
    paused_payouts: PayoutWorld,
) -> None:
    world, wallet = paused_payouts.world, paused_payouts.wallet
    refund = paused_payouts.owed_refund()
    payout = refund_payout_approve(refund_id=refund.pk, actor=FAY)
    world.node.rpc("anvil_setBalance", [wallet.address, "0x0"])  # it cannot pay the gas
    assert payout_broadcast(payout_id=payout.pk) == "rejected"
    payout.refresh_from_db()
    assert (payout.state, payout.awaiting) == ("recorded", "broadcast")
    assert "insufficient funds" in payout.evidence["node_said"].lower()
    assert paused_payouts.wallet_sent() == 0

    world.node.rpc("anvil_setBalance", [wallet.address, hex(10**18)])
    assert payouts_reconcile(now=later()) == {"broadcast_sent": 1}
    world.node.mine(FINALITY_DEPTH)
    assert payouts_reconcile(now=later(2)) == {"confirmed": 1}
    assert paused_payouts.wallet_sent() == 1


@pytest.mark.django_db
def test_a_payout_fails_only_on_proof_reverted_past_finality(
    x402_world: X402World, settings: Any
) -> None:
    payouts = add_refund_wallet(x402_world, settings, funds=0)  # holds no USDC: it reverts
    refund = payouts.owed_refund()
    payout = refund_payout_approve(refund_id=refund.pk, actor=FAY)
    assert payout_broadcast(payout_id=payout.pk) == "sent"
    receipt = x402_world.w3.eth.wait_for_transaction_receipt(
        HexStr(str(payout.tx_hash)), timeout=10
    )
    assert receipt["status"] == 0
    # Reverted but not final: not told failed yet.
    assert payouts_reconcile(now=later()) == {"pending:finality": 1}
    x402_world.node.mine(FINALITY_DEPTH)
    assert payouts_reconcile(now=later(2)) == {"failed": 1}
    payout.refresh_from_db()
    refund.refresh_from_db()
    assert (payout.state, payout.reason_code) == ("failed", "payout_reverted")
    assert refund.state == "owed"
    # No money moved, none can: a new payout of the refund may be approved.
    again = refund_payout_approve(refund_id=refund.pk, actor=FAY)
    assert again.state == "recorded" and again.nonce == 1


@pytest.mark.django_db
def test_another_destination_needs_a_second_approver_before_any_broadcast(
    payouts: PayoutWorld,
) -> None:
    world = payouts.world
    payer, elsewhere = world.payers[0], world.payers[2]
    refund = payouts.owed_refund(payer)
    before = payouts.balance(elsewhere.address)
    payout = refund_payout_approve(refund_id=refund.pk, actor=FAY, destination=elsewhere.address)

    assert (payout.state, payout.awaiting) == ("awaiting_approval", "second_approval")
    assert (payout.tx_hash, payout.nonce, payout.raw_transaction) == (None, None, "")
    assert not OutboxMessage.objects.filter(job="payout_broadcast").exists()
    assert payout_broadcast(payout_id=payout.pk) == "not_recorded:awaiting_approval"
    assert payouts_reconcile(now=later()) == {}
    with pytest.raises(PayoutRefused) as same_person:
        payout_second_approve(payout_id=payout.pk, actor=FAY)
    assert same_person.value.code == ErrorCode.PAYOUT_SECOND_APPROVER_REQUIRED
    payout.refresh_from_db()
    assert payout.state == "awaiting_approval" and payouts.wallet_sent() == 0

    approved = payout_second_approve(payout_id=payout.pk, actor=GUS)
    assert (approved.state, approved.second_approved_by, approved.nonce) == (
        "recorded",
        "gus-finance",
        0,
    )
    assert payout_broadcast(payout_id=payout.pk) == "sent"
    world.node.mine(FINALITY_DEPTH)
    assert payouts_reconcile(now=later()) == {"confirmed": 1}
    refund.refresh_from_db()
    assert (refund.state, refund.paid_reference) == ("paid", approved.tx_hash)
    assert payouts.balance(elsewhere.address) - before == PRICE


@pytest.mark.django_db
def test_a_payout_awaiting_its_second_approver_can_be_cancelled_and_frees_its_refund(
    payouts: PayoutWorld,
) -> None:
    refund = payouts.owed_refund()
    payout = refund_payout_approve(
        refund_id=refund.pk, actor=FAY, destination=payouts.world.payers[2].address
    )
    payout_cancel(payout_id=payout.pk, actor=GUS)
    payout.refresh_from_db()
    assert payout.state == "cancelled"
    assert refund_payout_approve(refund_id=refund.pk, actor=FAY).state == "recorded"


@pytest.mark.django_db
def test_refusals_name_their_code_and_record_nothing(payouts: PayoutWorld, settings: Any) -> None:
    refund = payouts.owed_refund()
    with pytest.raises(PayoutRefused) as refused:
        refund_payout_approve(refund_id=refund.pk, actor=FAY, destination="0xnot-an-address")
    assert refused.value.code == ErrorCode.PAYOUT_DESTINATION_INVALID
    paid = payouts.owed_refund()
    Refund.objects.filter(pk=paid.pk).update(payback_tx_hash="0x" + "ab" * 32)
    with pytest.raises(PayoutRefused) as named:
        refund_payout_approve(refund_id=paid.pk, actor=FAY)
    assert named.value.code == ErrorCode.PAYOUT_NOT_PAYABLE
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "PAYOUT_DAILY_CAPS": {}}
    with pytest.raises(PayoutRefused) as uncapped:
        refund_payout_approve(refund_id=refund.pk, actor=FAY)
    assert uncapped.value.code == ErrorCode.PAYOUT_CAP_EXCEEDED
    payouts.world.network_settings["refund_wallet_key"] = ""
    with pytest.raises(PayoutRefused) as no_wallet:
        refund_payout_approve(refund_id=refund.pk, actor=FAY)
    assert no_wallet.value.code == ErrorCode.PAYOUT_WALLET_UNCONFIGURED
    assert not Payout.objects.exists() and payouts.wallet_sent() == 0


@pytest.mark.django_db
def test_a_refund_with_a_live_payout_is_not_closed_by_another_transfer(
    payouts: PayoutWorld,
) -> None:
    world = payouts.world
    payer = world.payers[0]
    refund = payouts.owed_refund(payer)
    payout = refund_payout_approve(refund_id=refund.pk, actor=FAY)
    # Someone also pays it back by hand from a seller wallet: a transfer the checks accept.
    mint(world.w3, world.token, world.deployer, world.seller.address, PRICE)
    by_hand = erc20_transfer(world.w3, world.token, world.seller, payer.address, PRICE)
    world.node.mine(FINALITY_DEPTH)
    with pytest.raises(RefundPaybackRefused) as refused:
        purchase_refund_payback_close(refund_id=refund.pk, tx_hash=by_hand, now=None, actor=FAY)
    assert refused.value.code == "payback_payout_live"
    refund.refresh_from_db()
    assert refund.state == "owed"
    # The payout's own transfer still closes it.
    assert payout_broadcast(payout_id=payout.pk) == "sent"
    world.node.mine(FINALITY_DEPTH)
    assert payouts_reconcile(now=later()) == {"confirmed": 1}


@pytest.mark.django_db
def test_a_payout_whose_nonce_another_transaction_took_fails_once_that_is_final(
    payouts: PayoutWorld,
) -> None:
    world = payouts.world
    refund = payouts.owed_refund()
    payout = refund_payout_approve(refund_id=refund.pk, actor=FAY)
    # The wallet's key used outside Tollbooth: another transaction takes the payout's nonce.
    erc20_transfer(world.w3, world.token, payouts.wallet, world.payers[2].address, 1)
    assert payout_broadcast(payout_id=payout.pk) == "known"  # "nonce too low": judged next
    assert payouts_reconcile(now=later()) == {"pending:finality": 1}
    payout.refresh_from_db()
    assert (payout.state, payout.evidence["look"]) == ("broadcast", "nonce_taken")
    world.node.mine(FINALITY_DEPTH)
    assert payouts_reconcile(now=later(2)) == {"failed": 1}
    payout.refresh_from_db()
    refund.refresh_from_db()
    assert (payout.state, payout.reason_code, refund.state) == (
        "failed",
        "payout_nonce_taken",
        "owed",
    )
    assert payouts.balance(world.payers[0].address) == 100 * 10**6  # nothing reached the payer
