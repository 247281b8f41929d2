"""The books add up to the chain's own transfers. On a real anvil node: buyers pay over x402
(direct mode: our relayer broadcasts and pays gas), one payment comes from the seller's own
treasury, one sale is paid back on chain (the seller's wallet pays that gas); the period's
export is then compared with the token's Transfer logs, the receipts' gas and the relayer's
and the seller's ETH balances. In facilitator mode
the facilitator pays the gas, and the export says so and counts none."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient
from web3 import Web3

from backoffice.books import Period
from backoffice.books_export import books_export
from core.actors import Actor
from payments.chain.token import token_contract
from payments.models import PaymentAttempt
from payments.rails.x402.chain import TRANSFER_TOPIC
from payments.services import refund_record
from purchases.services.remedy.paybacks import purchase_refund_payback_close
from purchases.services.settle.finality import watch_unfinal_settlements
from tests.x402.e2e import sign_payment

pytestmark = [pytest.mark.postgres]

USDC = Decimal(10) ** 6
ETH = Decimal(10) ** 18


def _buy(client: APIClient, world: Any, payer: Any, title: str) -> PaymentAttempt:
    body = {"title": title, "csv": "region,units\nnorth,3\n"}
    required = client.post(world.paid_url, body, format="json")
    assert required.status_code == 402, required.content
    payment = sign_payment(required["PAYMENT-REQUIRED"], payer, None)
    answer = client.post(world.paid_url, body, format="json", HTTP_PAYMENT_SIGNATURE=payment)
    assert answer.status_code in (200, 202), answer.content
    return PaymentAttempt.objects.filter(payer__iexact=payer.address).latest("pk")


def _pay_back(world: Any, attempt: PaymentAttempt) -> str:
    """The seller sends the money back from its own wallet: an ordinary token transfer."""
    token = token_contract(world.w3, world.token)
    tx = token.functions.transfer(Web3.to_checksum_address(attempt.payer), attempt.amount)
    nonce = world.w3.eth.get_transaction_count(world.seller.address)
    built = tx.build_transaction({"from": world.seller.address, "chainId": 31337, "nonce": nonce})
    signed = world.seller.sign_transaction(built)
    sent = world.w3.eth.send_raw_transaction(signed.raw_transaction)
    assert world.w3.eth.wait_for_transaction_receipt(sent, timeout=10)["status"] == 1
    return sent.to_0x_hex()


def _transfers(world: Any, from_block: int) -> list[tuple[str, str, int, str]]:
    """(from, to, value, tx hash) of every Transfer of the world's token, as the chain logs."""
    logs = world.w3.eth.get_logs({"address": Web3.to_checksum_address(world.token),
                                  "fromBlock": from_block, "toBlock": "latest",
                                  "topics": [TRANSFER_TOPIC]})  # fmt: skip
    return [
        ("0x" + log["topics"][1].hex()[-40:], "0x" + log["topics"][2].hex()[-40:],
         int.from_bytes(log["data"], "big"), log["transactionHash"].to_0x_hex())
        for log in logs
    ]  # fmt: skip


def _period_to_now(world: Any, since: datetime) -> tuple[Period, datetime]:
    # Closed: it ends after the latest block (anvil's clock may run a second ahead of ours).
    head = datetime.fromtimestamp(world.w3.eth.get_block("latest")["timestamp"], tz=UTC)
    end = max(head, timezone.now()) + timedelta(seconds=1)
    return Period(since, end), end


def _rows(content: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(content.decode())))


@pytest.mark.django_db
def test_the_period_export_adds_up_to_the_chains_own_transfers(x402_world, settings):
    world, client = x402_world, APIClient()
    buyer_1, buyer_2, treasury = world.payers[:3]
    settings.TOLLBOOTH = {
        **settings.TOLLBOOTH,
        "SELLER_WALLETS": [treasury.address],
    }  # the seller's own wallet, paying itself
    since = timezone.now() - timedelta(minutes=1)
    first_block = world.w3.eth.block_number + 1
    relayer_eth_before = world.w3.eth.get_balance(world.relayer.address)
    seller_eth_before = world.w3.eth.get_balance(world.seller.address)

    sold = [_buy(client, world, payer, f"Sales {i}")
            for i, payer in enumerate((buyer_1, buyer_2, treasury))]  # fmt: skip
    # Gas and sender are recorded as the settlement is confirmed (direct mode's receipt).
    for attempt in sold:
        attempt.refresh_from_db()
        assert attempt.state == "succeeded" and attempt.gas_used and attempt.effective_gas_price
        assert attempt.sent_by == world.relayer.address.lower()
    refund, _ = refund_record(attempt=sold[0], method="pay_back", reason_code="goodwill")
    payback = _pay_back(world, sold[0])
    # Closed on the chain's proof of the payback, as finance closes it.
    closed = purchase_refund_payback_close(
        refund_id=refund.pk, tx_hash=payback, now=timezone.now(), actor=Actor.staff("finance")
    )
    assert closed.verdict.closes, closed.verdict

    period, now = _period_to_now(world, since)
    first = books_export(period=period, created_by="finance", now=now).content
    # The first export read the block times from the chain; the next one reads them stored.
    assert books_export(period=period, created_by="finance", now=now).content == first
    rows = _rows(first)
    (total,) = [r for r in rows if r["record"] == "total"]
    sales = {r["transaction"]: r for r in rows if r["record"] == "sale"}

    # The chain's own account of the same period.
    seller = world.seller.address.lower()
    ours = {seller, treasury.address.lower(), world.relayer.address.lower()}
    transfers = _transfers(world, first_block)
    from_buyers = sum(v for src, dst, v, _ in transfers if dst == seller and src not in ours)
    from_ourselves = sum(v for src, dst, v, _ in transfers if dst == seller and src in ours)
    paid_back = sum(v for src, dst, v, _ in transfers if src == seller and dst not in ours)
    price = world.offering.price
    assert (from_buyers, from_ourselves, paid_back) == (2 * price, price, price)
    assert Decimal(total["revenue"]) == from_buyers / USDC
    assert Decimal(total["excluded"]) == from_ourselves / USDC
    assert Decimal(total["refunds"]) == paid_back / USDC
    assert Decimal(total["net"]) == (from_buyers - paid_back) / USDC
    # Each sale is the transfer its transaction logged, timed by its block, with its gas.
    assert set(sales) == {tx for src, dst, _, tx in transfers if dst == seller}
    for tx_hash, row in sales.items():
        receipt = world.w3.eth.get_transaction_receipt(tx_hash)
        block = world.w3.eth.get_block(receipt["blockNumber"])
        assert row["time_utc"] == datetime.fromtimestamp(block["timestamp"], tz=UTC).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        )
        assert row["block"] == str(receipt["blockNumber"])
        assert Decimal(row["gas"]) == receipt["gasUsed"] * receipt["effectiveGasPrice"] / ETH
    # The payback's gas is a cost too: the seller's wallet sent it, and sent nothing else.
    (paid_row,) = [r for r in rows if r["record"] == "refund"]
    payback_spent = seller_eth_before - world.w3.eth.get_balance(world.seller.address)
    assert (Decimal(paid_row["gas"]), paid_row["gas_symbol"]) == (payback_spent / ETH, "ETH")
    # The gas in the books is exactly the ETH our relayer and the seller's wallet spent.
    spent = relayer_eth_before - world.w3.eth.get_balance(world.relayer.address)
    assert spent > 0 and payback_spent > 0
    assert Decimal(total["gas"]) == (spent + payback_spent) / ETH
    assert sales[str(sold[2].tx_hash)]["self_payment"] == "yes"


@pytest.mark.django_db
def test_in_facilitator_mode_the_export_counts_no_gas_of_ours_and_says_so(
    make_facilitated_world, settings
):
    world, _facilitator = make_facilitated_world()
    since = timezone.now() - timedelta(minutes=1)
    relayer_eth_before = world.w3.eth.get_balance(world.relayer.address)
    attempt = _buy(APIClient(), world, world.payers[0], "Sales")
    assert attempt.state == "succeeded"

    period, now = _period_to_now(world, since)
    rows = _rows(books_export(period=period, created_by="finance", now=now).content)
    (sale,) = [r for r in rows if r["record"] == "sale"]
    receipt = world.w3.eth.get_transaction_receipt(sale["transaction"])
    assert receipt["from"].lower() != world.relayer.address.lower()  # the facilitator sent it
    assert (sale["gas"], sale["revenue"]) == ("", "0.250000")
    assert "facilitator" in sale["note"]
    (total,) = [r for r in rows if r["record"] == "total"]
    assert Decimal(total["gas"]) == 0
    assert world.w3.eth.get_balance(world.relayer.address) == relayer_eth_before
    notes = [r["note"] for r in rows if r["record"] == "note"]
    assert "eip155:31337: settled by a facilitator (facilitator mode): no gas of ours" in notes


@pytest.mark.django_db
def test_the_finality_watch_records_the_block_time_once_the_block_is_final(
    make_x402_world, settings
):
    x402_world = make_x402_world()
    # Final 3 blocks deep: confirmed at depth 1, the settlement is watched, not final.
    network = x402_world.network_settings
    settings.X402_NETWORKS = {
        **settings.X402_NETWORKS,
        x402_world.offering.network: {**network, "finality": "depth", "finality_depth": 3},
    }
    attempt = _buy(APIClient(), x402_world, x402_world.payers[0], "Sales")
    assert attempt.block_at is None  # confirmed, not final yet: its block may still change
    x402_world.node.mine(2)
    stats = watch_unfinal_settlements(now=timezone.now() + timedelta(minutes=1))
    assert stats["final"] == 1
    attempt.refresh_from_db()
    receipt = x402_world.w3.eth.get_transaction_receipt(attempt.tx_hash)
    stamp = x402_world.w3.eth.get_block(receipt["blockNumber"])["timestamp"]
    assert attempt.final_at is not None
    assert attempt.block_at == datetime.fromtimestamp(stamp, tz=UTC)
    assert attempt.gas_used == receipt["gasUsed"]
    assert attempt.effective_gas_price == receipt["effectiveGasPrice"]
