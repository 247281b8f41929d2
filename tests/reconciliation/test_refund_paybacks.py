"""A chain refund closes only on a payback the chain proves (issue 21 §1).

Every payback here is a real ERC-20 transfer on the local anvil chain: to the wrong wallet,
of the wrong amount or token, not mined, reverted, already closing another refund, from a
wallet that is not the seller's; each is refused with the code of the failed check, and the
right one closes. A payback not final yet stays pending until the watch sees it final; a
payback nobody named is found by the watch and offered to finance as a match.
"""

from __future__ import annotations

import io
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from eth_account.signers.local import LocalAccount
from eth_typing import HexStr

from backoffice.roles import roles_ensure
from core.actors import Actor
from devtools.test_token import deploy_test_usdc, mint
from payments.models import Refund
from payments.paybacks import RefundPaybackRefused
from purchases.models import JobRun, PurchaseEvent
from purchases.services.remedy.paybacks import (
    purchase_refund_match_confirm,
    purchase_refund_payback_close,
    refund_paybacks_watch,
)
from tests.factories import PaymentAttemptFactory, PurchaseFactory, RefundFactory
from tests.fixtures.anvil import erc20_transfer
from tests.x402.e2e import NETWORK, PRICE, X402World

FINANCE = Actor.staff("fay-finance")


def send_transfer(
    world: X402World,
    sender: LocalAccount,
    to: str,
    amount: int,
    *,
    token: str | None = None,
    gas: int | None = None,
    wait: bool = True,
) -> str:
    return erc20_transfer(world.w3, token or world.token, sender, to, amount, gas=gas, wait=wait)


def owed_refund(world: X402World, payer: LocalAccount, amount: int = PRICE) -> Refund:
    """A chain refund owed to `payer` for a purchase of the world's offering."""
    purchase = PurchaseFactory.create(quote__offering=world.offering, paid=True)
    attempt = PaymentAttemptFactory.create(
        purchase=purchase,
        payer=payer.address,
        network=NETWORK,
        asset=world.token,
        amount=PRICE,
        succeeded=True,
    )
    return RefundFactory.create(payment_attempt=attempt, amount=amount)


def fund_seller(world: X402World, amount: int = 10 * PRICE) -> None:
    mint(world.w3, world.token, world.deployer, world.seller.address, amount)


@dataclass(frozen=True)
class Owed:
    """A world whose seller holds enough to pay back, and a chain refund owed to its first
    payer (the setup of nearly every test here)."""

    world: X402World
    payer: LocalAccount
    refund: Refund


def owed_setup(world: X402World) -> Owed:
    fund_seller(world)
    return Owed(world, world.payers[0], owed_refund(world, world.payers[0]))


@pytest.fixture
def owed(x402_world: X402World, db: None) -> Owed:
    return owed_setup(x402_world)


def refused_code(refund: Refund, tx_hash: str) -> str:
    with pytest.raises(RefundPaybackRefused) as refused:
        purchase_refund_payback_close(refund_id=refund.pk, tx_hash=tx_hash, now=None, actor=FINANCE)
    refund.refresh_from_db()
    assert (refund.state, refund.paid_reference, refund.payback_log_index) == ("owed", "", None)
    return refused.value.code.value


@pytest.mark.django_db
def test_a_payback_that_fails_a_check_is_refused_by_that_checks_code(owed: Owed) -> None:
    world, payer, refund = owed.world, owed.payer, owed.refund
    other, seller = world.payers[1], world.seller

    wrong_address = send_transfer(world, seller, other.address, PRICE)
    assert refused_code(refund, wrong_address) == "payback_wrong_destination"
    wrong_amount = send_transfer(world, seller, payer.address, PRICE - 1)
    assert refused_code(refund, wrong_amount) == "payback_wrong_amount"
    other_token = deploy_test_usdc(world.w3, world.deployer, "Other", "1")
    mint(world.w3, other_token, world.deployer, seller.address, PRICE)
    wrong_token = send_transfer(world, seller, payer.address, PRICE, token=other_token)
    assert refused_code(refund, wrong_token) == "payback_wrong_token"
    not_seller = send_transfer(world, other, payer.address, PRICE)
    assert refused_code(refund, not_seller) == "payback_not_from_seller"
    # More than the seller holds: mined (fixed gas, no estimate) and reverted.
    reverted = send_transfer(world, seller, payer.address, 1000 * PRICE, gas=120_000)
    assert world.w3.eth.get_transaction_receipt(HexStr(reverted))["status"] == 0
    assert refused_code(refund, reverted) == "payback_reverted"
    assert refused_code(refund, "0x" + secrets.token_hex(32)) == "payback_not_found"
    assert refused_code(refund, "0xdead") == "payback_reference_malformed"
    # Nothing refused left a trace on the refund or closed it.
    assert not PurchaseEvent.objects.filter(subject="refund", to_state="paid").exists()

    right = send_transfer(world, seller, payer.address, PRICE)
    recorded = purchase_refund_payback_close(
        refund_id=refund.pk, tx_hash=right.upper().replace("0X", "0x"), now=None, actor=FINANCE
    )
    refund.refresh_from_db()
    assert recorded.verdict.code == "payback_closes"
    assert (refund.state, refund.paid_reference, refund.paid_by) == ("paid", right, "fay-finance")
    assert refund.payback_log_index == 0 and refund.payback_block_number is not None
    event = PurchaseEvent.objects.get(subject="refund", to_state="paid")
    assert (event.reason_code, event.evidence["tx_hash"]) == ("payback_closes", right)
    # The same payback again: nothing new (idempotent), another one: refused.
    purchase_refund_payback_close(refund_id=refund.pk, tx_hash=right, now=None, actor=FINANCE)
    assert PurchaseEvent.objects.filter(subject="refund", to_state="paid").count() == 1
    with pytest.raises(ValueError, match="already paid back"):
        purchase_refund_payback_close(
            refund_id=refund.pk, tx_hash=wrong_amount, now=None, actor=FINANCE
        )


@pytest.mark.django_db
def test_a_payback_closes_one_refund_only(owed: Owed) -> None:
    world, payer, first = owed.world, owed.payer, owed.refund
    second = owed_refund(world, payer)
    payback = send_transfer(world, world.seller, payer.address, PRICE)
    purchase_refund_payback_close(refund_id=first.pk, tx_hash=payback, now=None, actor=FINANCE)
    assert refused_code(second, payback) == "payback_already_used"
    first.refresh_from_db()
    assert first.state == "paid"


@pytest.mark.django_db
def test_a_payback_from_a_wallet_listed_in_settings_counts_as_the_sellers(
    x402_world: X402World, settings: Any
) -> None:
    world = x402_world
    payer, treasury = world.payers[0], world.payers[2]
    refund = owed_refund(world, payer)
    payback = send_transfer(world, treasury, payer.address, PRICE)
    assert refused_code(refund, payback) == "payback_not_from_seller"
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "SELLER_WALLETS": [treasury.address]}
    purchase_refund_payback_close(refund_id=refund.pk, tx_hash=payback, now=None, actor=FINANCE)
    refund.refresh_from_db()
    assert refund.state == "paid"


@pytest.mark.django_db
def test_a_payback_not_final_yet_is_pending_and_the_watch_closes_it_once_final(
    owed: Owed,
) -> None:
    world, payer, refund = owed.world, owed.payer, owed.refund
    world.network_settings["finality_depth"] = 3
    payback = send_transfer(world, world.seller, payer.address, PRICE)
    now = timezone.now()
    recorded = purchase_refund_payback_close(
        refund_id=refund.pk, tx_hash=payback, now=now, actor=FINANCE
    )
    refund.refresh_from_db()
    assert recorded.verdict.pending and not recorded.verdict.closes
    assert (refund.state, refund.payback_code) == ("owed", "payback_awaiting_finality")
    assert refund.payback_next_check_at == now + timedelta(seconds=60)
    assert (refund.payback_evidence["depth"], refund.payback_evidence["finality_depth"]) == (1, 3)
    # Not due yet: the watch leaves it; due but still not final: still pending.
    assert refund_paybacks_watch(now=now)["pending"] == 0
    world.node.mine(1)
    later = now + timedelta(seconds=61)
    assert refund_paybacks_watch(now=later)["pending"] == 1
    refund.refresh_from_db()
    assert refund.state == "owed" and refund.payback_evidence["depth"] == 2
    world.node.mine(1)
    assert refund_paybacks_watch(now=later + timedelta(seconds=61))["closed"] == 1
    refund.refresh_from_db()
    assert (refund.state, refund.paid_reference, refund.paid_by) == (
        "paid",
        payback,
        "payback_watch",
    )
    assert refund.payback_next_check_at is None


@pytest.mark.django_db
def test_a_payback_not_mined_is_pending_never_failed(x402_paused_world: X402World) -> None:
    world = x402_paused_world
    world.node.set_automine(True)
    owed = owed_setup(world)
    payer, refund = owed.payer, owed.refund
    world.node.set_automine(False)
    payback = send_transfer(world, world.seller, payer.address, PRICE, gas=80_000, wait=False)
    now = timezone.now()
    recorded = purchase_refund_payback_close(
        refund_id=refund.pk, tx_hash=payback, now=now, actor=FINANCE
    )
    refund.refresh_from_db()
    assert recorded.verdict.code == "payback_not_mined" and recorded.verdict.pending
    assert (refund.state, refund.payback_tx_hash, refund.paid_reference) == ("owed", payback, "")
    world.node.mine(1)
    assert refund_paybacks_watch(now=now + timedelta(seconds=61))["closed"] == 1
    refund.refresh_from_db()
    assert refund.state == "paid"


@pytest.mark.django_db
def test_a_payback_seen_on_chain_is_offered_as_a_match_and_confirmed_in_one_step(
    owed: Owed,
) -> None:
    world, payer, refund = owed.world, owed.payer, owed.refund
    other = world.payers[1]
    untouched = owed_refund(world, other, amount=PRICE // 2)
    payback = send_transfer(world, world.seller, payer.address, PRICE)
    send_transfer(world, world.seller, other.address, PRICE)  # not the amount owed to `other`
    stats = refund_paybacks_watch()
    assert stats["matched"] == 1
    refund.refresh_from_db()
    untouched.refresh_from_db()
    assert (refund.state, refund.match_tx_hash, refund.match_log_index) == ("owed", payback, 0)
    assert untouched.match_tx_hash == ""
    assert PurchaseEvent.objects.filter(reason_code="payback_match_found").count() == 1
    assert refund_paybacks_watch()["matched"] == 0  # offered once
    runs = JobRun.objects.filter(job="refund_paybacks").order_by("pk")
    assert [run.stats["matched"] for run in runs] == [1, 0]  # each run on record (/metrics)

    recorded = purchase_refund_match_confirm(refund_id=refund.pk, now=None, actor=FINANCE)
    refund.refresh_from_db()
    assert recorded.verdict.closes
    assert (refund.state, refund.paid_reference, refund.match_tx_hash) == ("paid", payback, "")


def _finance_client() -> Client:
    user = User.objects.create_user(username="fay-finance", is_staff=True)
    user.groups.add(roles_ensure()["finance"])
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.django_db
def test_the_admin_form_names_the_failed_check_and_closes_the_right_payback(
    owed: Owed,
) -> None:
    world, payer, refund = owed.world, owed.payer, owed.refund
    finance = _finance_client()
    url = reverse("admin:payments_refund_changelist")

    def mark(tx_hash: str) -> Any:
        return finance.post(
            url,
            {
                "action": "mark_paid_back",
                "_selected_action": [refund.pk],
                "apply": "1",
                f"reference_{refund.pk}": tx_hash,
            },
            follow=True,
        )

    wrong = send_transfer(world, world.seller, payer.address, PRICE - 5)
    page = mark(wrong).content.decode()
    assert (
        "payback_wrong_amount: The transfer to the destination is not of the amount owed." in page
    )
    assert "Not every refund could be closed" in page
    refund.refresh_from_db()
    assert refund.state == "owed"
    right = send_transfer(world, world.seller, payer.address, PRICE)
    page = mark(right).content.decode()
    assert "Marked 1 refund(s) paid back." in page
    refund.refresh_from_db()
    assert (refund.state, refund.paid_reference) == ("paid", right)
    detail = finance.get(reverse("admin:payments_refund_change", args=[refund.pk]))
    assert f"closed on chain by {right} (log 0)" in detail.content.decode()


@pytest.mark.django_db
def test_a_pending_payback_a_reorg_undoes_is_dropped_and_the_refund_stays_owed(
    x402_paused_world: X402World,
) -> None:
    world = x402_paused_world
    world.network_settings["finality_depth"] = 3
    world.node.set_automine(True)
    owed = owed_setup(world)
    payer, refund = owed.payer, owed.refund
    snapshot = world.node.rpc("evm_snapshot")
    payback = send_transfer(world, world.seller, payer.address, PRICE)
    now = timezone.now()
    purchase_refund_payback_close(refund_id=refund.pk, tx_hash=payback, now=now, actor=FINANCE)
    refund.refresh_from_db()
    assert (refund.payback_code, refund.payback_tx_hash) == ("payback_awaiting_finality", payback)
    world.node.rpc("evm_revert", [snapshot])  # the block holding the payback is gone
    world.node.rpc("anvil_dropAllTransactions")
    stats = refund_paybacks_watch(now=now + timedelta(seconds=61))
    assert (stats["dropped"], stats["closed"]) == (1, 0)
    refund.refresh_from_db()
    assert (refund.state, refund.payback_tx_hash, refund.payback_next_check_at) == (
        "owed",
        "",
        None,
    )
    assert refund.payback_code == "payback_not_found"
    event = PurchaseEvent.objects.filter(subject="refund").order_by("pk").last()
    assert event is not None
    assert (event.reason_code, event.evidence["tx_hash"]) == ("payback_not_found", payback)


@pytest.mark.django_db
def test_the_watch_skips_a_network_it_cannot_search_and_matches_the_others(
    owed: Owed, settings: Any
) -> None:
    world, payer, refund = owed.world, owed.payer, owed.refund
    elsewhere = owed_refund(world, world.payers[1])
    Refund.objects.filter(pk=elsewhere.pk).update(network="eip155:84532")
    sepolia = dict(settings.X402_NETWORKS["eip155:84532"], token_address="")
    settings.X402_NETWORKS = {**settings.X402_NETWORKS, "eip155:84532": sepolia}
    send_transfer(world, world.seller, payer.address, PRICE)
    stats = refund_paybacks_watch()
    assert (stats["matched"], stats["unavailable"]) == (1, 1)
    refund.refresh_from_db()
    assert refund.match_tx_hash.startswith("0x")


@pytest.mark.django_db
def test_the_command_names_the_failed_check_and_closes_the_right_payback(
    owed: Owed,
) -> None:
    world, payer, refund = owed.world, owed.payer, owed.refund
    wrong = send_transfer(world, world.seller, world.payers[1].address, PRICE)
    with pytest.raises(CommandError, match="refused: payback_wrong_destination"):
        call_command("refund_payback", str(refund.pk), wrong, "--by", "fay-finance")
    right = send_transfer(world, world.seller, payer.address, PRICE)
    out = io.StringIO()
    call_command("refund_payback", str(refund.pk), right, "--by", "fay-finance", stdout=out)
    assert out.getvalue().strip() == (
        f"refund {refund.pk} paid back: closed on chain by {right} (log 0)"
    )
    refund.refresh_from_db()
    assert (refund.state, refund.paid_by) == ("paid", "fay-finance")
