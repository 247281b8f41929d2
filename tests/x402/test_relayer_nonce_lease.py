"""A relayer nonce whose holder vanished is closed once its lease lapses, not by the 5-minute
heal (the multi-host bench: a web host cut off mid-load left nonces that were never sent,
and 186 later settlements queued behind them for up to 325 s).

Real processes hold the nonces and are SIGKILLed before they send: one that only took a
nonce, and a web server that recorded its signed settlement and was cut off before the send
reached the node. Real anvil chain (automining), real PostgreSQL; no heal job runs unless a
test calls it. Nothing is sent twice: the seller's balance, every payer's balance and the
token's Transfer logs are counted.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
from django.utils import timezone
from eth_typing import HexStr
from rest_framework.test import APIClient
from web3 import Web3
from web3.exceptions import TransactionNotFound

from payments.chain.token import balance_of
from payments.models import PaymentAttempt, RelayerAccount
from payments.rails.x402.relayer import nonce_lease
from purchases.models import JobRun, PurchaseEvent
from purchases.services.jobs import reconcile
from tests.x402.e2e import FUNDED, PRICE, X402World, ask, sign_payment
from tests.x402.rpc_proxy import DROP_CONNECTION, RawReply, RpcProxy

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
ROOT = Path(__file__).resolve().parents[2]
# What the machine may add on top of the lease: the next agent's request, a block. Far
# below the heal job's old 300 s cadence, which is what this guards against.
BOUND = timedelta(seconds=20)
TRANSFER = Web3.keccak(text="Transfer(address,address,uint256)").to_0x_hex()

# A process that takes the relayer's next nonce as a settlement does, says which, and then
# hangs until it is killed: it never records or sends anything.
HOLDER = """
import sys, time
import django
django.setup()
from web3 import Web3
from payments.rails.x402.networks import network_config
from payments.rails.x402.relayer import relayer_nonce_lease
network = network_config("eip155:31337")
relayer = sys.argv[1]
pending = Web3(Web3.HTTPProvider(network.rpc_url)).eth.get_transaction_count(relayer, "pending")
lease = relayer_nonce_lease(network=network, address=relayer, chain_pending_nonce=pending)
print(lease.nonce, flush=True)
time.sleep(600)
"""


def _env(world: X402World, **extra: str) -> dict[str, str]:
    from tests.fixtures.worker import _database_url

    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings.test",
        "DATABASE_URL": _database_url(),
        "X402_LOCAL_RPC_URL": world.node.rpc_url,
        "X402_LOCAL_TOKEN": world.token,
        "X402_LOCAL_RELAYER_KEY": world.relayer.key.hex(),
        "X402_LOCAL_MODE": "direct",
        **extra,
    }


def _holder_killed(world: X402World) -> tuple[int, float]:
    """Start a holder, wait for its nonce, SIGKILL it: (the nonce, when it died)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, world.relayer.address],
        cwd=ROOT,
        env=_env(world),
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert holder.stdout is not None
        nonce = int(holder.stdout.readline())
    finally:
        holder.kill()  # SIGKILL: no cleanup, like a host cut off the network
        holder.wait(timeout=10)
    return nonce, time.monotonic()


def _pay(world: X402World, i: int, tag: str) -> tuple[Any, PaymentAttempt]:
    client = APIClient()
    data = {"title": f"{tag} {i}", "csv": "a\n1\n"}
    header = ask(client, world, data)["PAYMENT-REQUIRED"]
    payment = sign_payment(header, world.payers[i % 3], f"nonce-lease-{tag}-{i:08d}")
    answer = ask(client, world, data, payment=payment)
    assert answer.status_code in (200, 202), answer.content
    return answer, PaymentAttempt.objects.order_by("-pk").first()


def _mined(world: X402World, tx_hash: str | None) -> bool:
    assert tx_hash
    try:
        return world.w3.eth.get_transaction_receipt(HexStr(tx_hash))["status"] == 1
    except Exception:  # not mined yet
        return False


def _agents_until_mined(world: X402World, tx_hash: str | None, *, since: float, tag: str) -> int:
    """Agents keep paying, a second apart, until `tx_hash` is mined; how many paid. Fails
    once the lease plus BOUND has passed since `since`."""
    deadline = since + (nonce_lease() + BOUND).total_seconds()
    paid = 0
    while not _mined(world, tx_hash):
        assert time.monotonic() < deadline, "the gap was not closed within the lease + bound"
        _pay(world, 100 + paid, tag)
        paid += 1
        time.sleep(1)
    return paid


def _assert_each_paid_once(world: X402World, payments: int) -> None:
    assert world.seller_balance() == payments * PRICE
    token = Web3.to_checksum_address(world.token)
    logs = world.w3.eth.get_logs(
        {"address": token, "fromBlock": 0, "toBlock": "latest", "topics": [TRANSFER]}
    )
    seller_topic = "0x" + world.seller.address[2:].lower().rjust(64, "0")
    to_seller = [log for log in logs if log["topics"][2].to_0x_hex() == seller_topic]
    assert len(to_seller) == payments
    spent = sum(FUNDED - balance_of(world.w3, world.token, p.address) for p in world.payers)
    assert spent == payments * PRICE


def test_a_nonce_whose_holder_was_killed_is_filled_once_its_lease_lapses(make_x402_world):
    world = make_x402_world()
    nonce, killed_at = _holder_killed(world)
    assert nonce == 0

    queued, attempt = _pay(world, 0, "killed")  # its nonce 1 waits behind the dead one's
    assert queued.status_code == 202 and attempt.relayer_nonce == 1
    assert not _mined(world, attempt.tx_hash)

    later = _agents_until_mined(world, attempt.tx_hash, since=killed_at, tag="killed")

    assert later >= 1  # an agent after the lease closed it, before its own broadcast
    assert not JobRun.objects.filter(job="heal_relayers").exists()
    filler = _relayer_transaction_at(world, 0)  # a 0-value self-transfer took the nonce
    assert (filler["to"], filler["value"], filler["input"]) == (world.relayer.address, 0, b"")
    # The agent whose broadcast closed it says so on its timeline (what support reads).
    closed = [
        gap
        for event in PurchaseEvent.objects.filter(subject="payment_attempt.broadcast")
        for gap in event.evidence.get("relayer_gap_closed", [])
    ]
    assert closed == [
        {"relayer_nonce": 0, "action": "gap_filled", "tx_hash": filler["hash"].to_0x_hex(),
         "attempts": []}
    ]  # fmt: skip
    _assert_each_paid_once(world, 1 + later)


def test_a_settlement_recorded_by_a_killed_host_is_sent_once_when_its_lease_lapses(
    make_x402_world, start_server
):
    world = make_x402_world()
    proxy = _SendSwallower(world.node.rpc_url)
    host = start_server(_env(world, X402_LOCAL_RPC_URL=proxy.url, X402_RESULT_WAIT_SECONDS="0"))
    try:
        url = f"{host.url}{world.paid_url}"
        data = {"title": "cut off", "csv": "a\n1\n"}
        required = requests.post(url, json=data, timeout=10)
        payment = sign_payment(required.headers["PAYMENT-REQUIRED"], world.payers[0], None)
        sent = threading.Thread(
            target=_post_quietly, args=(url, data, payment), daemon=True
        )  # the agent's connection dies with the host
        sent.start()
        assert proxy.held.wait(timeout=60), "the host never tried to send"
        host.kill()  # cut off: its send never reached the node
        killed_at = time.monotonic()
        dead = PaymentAttempt.objects.get()
        assert dead.relayer_nonce == 0 and dead.raw_transaction
        assert not _mined(world, dead.tx_hash)

        queued, attempt = _pay(world, 0, "cut-off")
        assert queued.status_code == 202 and attempt.relayer_nonce == 1

        later = _agents_until_mined(world, attempt.tx_hash, since=killed_at, tag="cut-off")
    finally:
        proxy.release.set()
        proxy.close()

    # The dead host's own signed settlement was sent, byte for byte: its payment is made
    # once, and no filler took its nonce.
    assert _mined(world, dead.tx_hash)
    assert world.w3.eth.get_transaction(dead.tx_hash)["nonce"] == 0
    assert not JobRun.objects.filter(job="heal_relayers").exists()
    _assert_each_paid_once(world, 2 + later)
    reconcile.reconcile_pending_settlements(now=timezone.now() + timedelta(minutes=3))
    dead.refresh_from_db()
    assert dead.state == "succeeded"
    # The dead host's purchase's timeline says its transaction was re-sent for it.
    [note] = PurchaseEvent.objects.filter(
        subject="payment_attempt.relayer_gap_closed", purchase_id=dead.purchase_id
    )
    assert (note.reason_code, note.evidence["sent_tx_hash"]) == ("rebroadcast", dead.tx_hash)


def test_heal_leaves_a_nonce_within_its_lease_and_fills_it_once_lapsed(make_x402_world):
    """With no agent coming after the holder died, the frequent heal job closes the gap,
    but never inside the lease (the holder might still be sending)."""
    world = make_x402_world()
    before = timezone.now()  # the holder takes its nonce after this
    _holder_killed(world)
    _, attempt = _pay(world, 0, "heal")

    within = reconcile.heal_relayers(now=before + nonce_lease() - timedelta(seconds=1))
    assert "eip155:31337:gap_filled" not in within
    assert not _mined(world, attempt.tx_hash)

    observed = timezone.now()
    lapsed = reconcile.heal_relayers(now=observed + nonce_lease())
    assert lapsed["eip155:31337:gap_filled"] == 1
    again = reconcile.heal_relayers(now=observed + nonce_lease() + timedelta(seconds=1))
    assert "eip155:31337:gap_filled" not in again
    _wait(lambda: _mined(world, attempt.tx_hash))
    _assert_each_paid_once(world, 1)


def _relayer_transaction_at(world: X402World, nonce: int) -> Any:
    for number in range(world.w3.eth.block_number + 1):
        block: Any = world.w3.eth.get_block(number, full_transactions=True)
        for tx in block["transactions"]:
            if tx["from"] == world.relayer.address and tx["nonce"] == nonce:
                return tx
    raise AssertionError(f"no mined transaction of the relayer at nonce {nonce}")


def _wait(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _post_quietly(url: str, data: dict[str, str], payment: str) -> None:
    with contextlib.suppress(requests.RequestException):  # the host dies under it
        requests.post(url, json=data, headers={"PAYMENT-SIGNATURE": payment}, timeout=120)


class _SendSwallower(RpcProxy):
    """Forwards every call but eth_sendRawTransaction, which it holds and never passes on:
    the host is cut off after recording its settlement, before the send reaches the node."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.held = threading.Event()
        self.release = threading.Event()

    def forward(self, raw: bytes) -> RawReply:
        if b"eth_sendRawTransaction" in raw:
            self.held.set()
            self.release.wait(timeout=120)
            return DROP_CONNECTION
        return super().forward(raw)


def test_a_heal_run_with_nothing_to_heal_is_a_few_statements_and_two_rpc_calls(
    make_x402_world, settings
):
    """What lets heal-relayers run every few seconds (docs/reconciliation.md, 2.6b)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    world = make_x402_world()
    _pay(world, 0, "idle")  # the relayer's row exists, its one transaction is mined
    proxy = RpcProxy(world.node.rpc_url)
    settings.X402_NETWORKS["eip155:31337"]["rpc_url"] = proxy.url
    try:
        with CaptureQueriesContext(connection) as queries:
            stats = reconcile.heal_relayers()
    finally:
        proxy.close()

    assert dict(stats) == {}
    # The job's own record (INSERT, UPDATE), our unmined broadcasts and the relayer's row.
    statements = [q["sql"].split()[0] for q in queries.captured_queries]
    assert statements == ["INSERT", "SELECT", "SELECT", "UPDATE"]
    assert proxy.methods() == ["eth_getTransactionCount", "eth_getTransactionCount"]


def test_a_holder_slow_past_its_lease_settles_on_a_fresh_nonce_once(
    make_x402_world, start_server, settings
):
    """The holder is alive, only slow: it took nonce 0, then stalled before recording its
    signed settlement (here: its UPDATE waits on a row lock the test holds) while its lease
    lapsed, and the next broadcaster filled nonce 0. Its own transaction at nonce 0 can then
    never be mined: the node refuses it ("nonce too low"). The buyer's authorization is still
    unused and in its window, so the holder signs it again on a fresh nonce, records that on
    the attempt in place of the refused one, and sends it: the payment settles, once, and
    the timeline names both transactions. Before, the holder took the refusal for "sent
    before", waited for a receipt that never came, and the payment ended as
    authorization_expired_unused."""
    settings.X402_RELAYER_NONCE_LEASE_SECONDS = 1.0  # the in-process gap closer's lease
    world = make_x402_world()
    proxy = _FirstPrepareHeld(world.node.rpc_url)
    host = start_server(_env(world, X402_LOCAL_RPC_URL=proxy.url))
    hold: _RowHold | None = None
    answers: list[requests.Response] = []
    try:
        url = f"{host.url}{world.paid_url}"
        data = {"title": "slow holder", "csv": "a\n1\n"}
        required = requests.post(url, json=data, timeout=10)
        payment = sign_payment(required.headers["PAYMENT-REQUIRED"], world.payers[0], None)
        holder = threading.Thread(target=_post_into, args=(url, data, payment, answers))
        holder.start()
        assert proxy.held.wait(timeout=60), "the holder never prepared"
        slow = PaymentAttempt.objects.get()
        hold = _RowHold(slow.pk)  # its record of what it signed will wait on this lock
        proxy.go.set()
        _wait(lambda: RelayerAccount.objects.filter(next_nonce=1).exists())  # it holds 0
        _wait(_lease_lapsed)

        _, other = _pay(world, 1, "closer")  # its nonce 1 sits on the lapsed nonce 0
        assert other.relayer_nonce == 1 and _mined(world, other.tx_hash)
        filler = _relayer_transaction_at(world, 0)
        assert (filler["to"], filler["value"], filler["input"]) == (world.relayer.address, 0, b"")

        hold.release.set()  # the holder wakes up, records, sends its nonce-0 transaction
        holder.join(timeout=120)
    finally:
        if hold is not None:
            hold.release.set()
        proxy.go.set()
        proxy.close()

    [answer] = answers
    assert answer.status_code in (200, 202), answer.content
    slow.refresh_from_db()
    assert slow.state == "succeeded", (slow.state, slow.reason_code)
    assert slow.relayer_nonce == 2 and slow.resubmissions == 1
    assert _mined(world, slow.tx_hash)
    _assert_each_paid_once(world, 2)
    # The record explains it: the first broadcast names the refused transaction at nonce 0
    # (which the node never took), the resubmission names both.
    events = PurchaseEvent.objects.filter(purchase_id=slow.purchase_id)
    [first] = events.filter(subject="payment_attempt.broadcast")
    refused = first.evidence["tx_hash"]
    assert first.evidence["relayer_nonce"] == 0 and refused != slow.tx_hash
    with pytest.raises(TransactionNotFound):
        world.w3.eth.get_transaction(refused)
    [again] = events.filter(subject="payment_attempt.resubmitted")
    assert again.reason_code == "relayer_nonce_taken"
    assert {k: again.evidence[k] for k in ("try", "replaced_tx_hash", "replaced_relayer_nonce",
                                           "tx_hash", "relayer_nonce")} == {
        "try": 1, "replaced_tx_hash": refused, "replaced_relayer_nonce": 0,
        "tx_hash": slow.tx_hash, "relayer_nonce": 2,
    }  # fmt: skip
    assert again.evidence["nonce"] == slow.authorization_nonce  # the one authorization
    # Nothing is left to heal or to send again.
    reconcile.reconcile_pending_settlements(now=timezone.now() + timedelta(minutes=3))
    slow.refresh_from_db()
    assert (slow.state, slow.resubmissions) == ("succeeded", 1)
    _assert_each_paid_once(world, 2)


def _lease_lapsed() -> bool:
    """The relayer's pending count has stood where it is for a lease: its nonces lapsed."""
    since = RelayerAccount.objects.get().pending_seen_since
    return since is not None and timezone.now() - since > nonce_lease()


def _post_into(url: str, data: dict[str, str], payment: str, answers: list[Any]) -> None:
    answers.append(
        requests.post(url, json=data, headers={"PAYMENT-SIGNATURE": payment}, timeout=120)
    )


class _FirstPrepareHeld(RpcProxy):
    """Forwards every call; the first settlement's prepare (its read of the relayer's pending
    count) waits until `go`, so the test can stand in the holder's way before it records."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.held = threading.Event()
        self.go = threading.Event()

    def forward(self, raw: bytes) -> RawReply:
        if b"eth_getTransactionCount" in raw and not self.held.is_set():
            self.held.set()
            self.go.wait(timeout=120)
        return super().forward(raw)


class _RowHold:
    """A row lock on one attempt, held by a connection of its own until `release`: whoever
    writes the row meanwhile waits, as a paused or slow process would."""

    def __init__(self, attempt_id: int) -> None:
        self.locked = threading.Event()
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._hold, args=(attempt_id,), daemon=True)
        self.thread.start()
        assert self.locked.wait(timeout=30)

    def _hold(self, attempt_id: int) -> None:
        from django.db import connection, transaction

        try:
            with transaction.atomic():
                PaymentAttempt.objects.select_for_update().get(pk=attempt_id)
                self.locked.set()
                self.release.wait(timeout=120)
        finally:
            connection.close()
