"""Direct-mode settlement and relayer nonce healing, against real anvil nodes (no mocks)."""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from hexbytes import HexBytes
from web3.exceptions import TransactionNotFound

from core.waits import waited_out
from devtools.test_token import send_transfer_with_authorization
from payments.chain.token import authorization_state
from payments.models import RelayerAccount
from payments.rails.base import SettlementOutcome, SettlementStatus
from payments.rails.x402.direct import BroadcastNotPrepared, DirectSettler
from payments.rails.x402.relayer import relayer_heal, relayer_nonce_allocate
from payments.rails.x402.types import Authorization, PreparedBroadcast
from payments.signers import EnvRelayerKeySigner
from tests.x402.chain_env import CAIP2, FUNDED, PRICE, ChainEnv

CONFIRMED = SettlementStatus.CONFIRMED
PENDING = SettlementStatus.PENDING
FAILED = SettlementStatus.FAILED


def settler() -> DirectSettler:
    return DirectSettler(poll_interval=0.05)


def broadcast(env: ChainEnv, auth: Authorization, prepared: PreparedBroadcast) -> SettlementOutcome:
    # Slept through on this thread, as a resubmission does (core.waits).
    return waited_out(settler().broadcast(
        authorization=auth, requirements=env.requirements(amount=auth.value), network=env.network,
        prepared=prepared,
    ))  # fmt: skip


def settle(env: ChainEnv, auth: Authorization) -> tuple[PreparedBroadcast, SettlementOutcome]:
    prepared = settler().prepare(authorization=auth, network=env.network)
    return prepared, broadcast(env, auth, prepared)


def pending_nonce(env: ChainEnv) -> int:
    return env.w3.eth.get_transaction_count(env.relayer.address, "pending")


def next_nonce(env: ChainEnv) -> int:
    return RelayerAccount.objects.get(network=CAIP2, address=env.relayer.address).next_nonce


def heal(env: ChainEnv, *prepared: PreparedBroadcast, **kwargs: object) -> list[dict[str, object]]:
    known = [(p.relayer_nonce, p.raw_transaction) for p in prepared]
    signer = EnvRelayerKeySigner(network=CAIP2, key=env.network.relayer_private_key)
    return relayer_heal(network=env.network, w3=env.w3, account=signer,
                        known=known, **kwargs)  # type: ignore[arg-type]  # fmt: skip


def is_known(env: ChainEnv, tx_hash: str) -> bool:
    try:
        env.w3.eth.get_transaction(tx_hash)  # type: ignore[arg-type]
    except TransactionNotFound:
        return False
    return True


# --- the happy path ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_prepare_signs_without_sending_and_broadcast_confirms_once(direct_env: ChainEnv) -> None:
    env, auth = direct_env, direct_env.authorize()
    expected_nonce = pending_nonce(env)

    prepared = settler().prepare(authorization=auth, network=env.network)

    assert prepared.relayer_nonce == expected_nonce
    assert not is_known(env, prepared.tx_hash or "")  # signed, not sent
    assert next_nonce(env) == expected_nonce + 1
    outcome = broadcast(env, auth, prepared)
    receipt = env.w3.eth.get_transaction_receipt(prepared.tx_hash)  # type: ignore[arg-type]
    assert outcome.status == CONFIRMED
    assert outcome.tx_hash == prepared.tx_hash
    assert outcome.block_number == receipt["blockNumber"]
    assert receipt["from"] == env.relayer.address
    assert env.balance(env.seller) == PRICE
    assert env.balance(env.payer) == FUNDED - PRICE


@pytest.mark.django_db
def test_broadcasting_the_same_prepared_transaction_twice_transfers_once(
    direct_env: ChainEnv,
) -> None:
    env, auth = direct_env, direct_env.authorize()
    prepared, first = settle(env, auth)

    second = broadcast(env, auth, prepared)

    assert (first.status, second.status) == (CONFIRMED, CONFIRMED)
    assert first.tx_hash == second.tx_hash == prepared.tx_hash
    assert second.block_number == first.block_number
    assert env.balance(env.seller) == PRICE
    assert next_nonce(env) == (prepared.relayer_nonce or 0) + 1  # no second nonce spent


@pytest.mark.django_db
def test_a_second_transaction_for_a_used_authorization_reverts_and_moves_nothing(
    direct_env: ChainEnv,
) -> None:
    env, auth = direct_env, direct_env.authorize()
    _first_prepared, first = settle(env, auth)
    again = settler().prepare(authorization=auth, network=env.network)

    outcome = broadcast(env, auth, again)

    assert first.status == CONFIRMED
    assert outcome.status == FAILED
    assert outcome.reason_code == "transaction_reverted"
    assert outcome.tx_hash == again.tx_hash
    assert outcome.evidence["block_number"] == outcome.block_number is not None
    assert env.balance(env.seller) == PRICE  # charged once


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_settlements_pipeline_with_distinct_consecutive_nonces(
    direct_env: ChainEnv,
) -> None:
    env, count = direct_env, 8
    auths = [env.authorize() for _ in range(count)]
    start = pending_nonce(env)
    barrier = threading.Barrier(count)
    results: dict[int, tuple[PreparedBroadcast, SettlementOutcome]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=10)
            results[i] = settle(env, auths[i])
        except BaseException as exc:  # reported below, with the thread's traceback
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert errors == []
    nonces = sorted(p.relayer_nonce or 0 for p, _ in results.values())
    assert nonces == list(range(start, start + count))
    assert {o.status for _, o in results.values()} == {CONFIRMED}
    assert len({o.tx_hash for _, o in results.values()}) == count
    assert env.balance(env.seller) == count * PRICE
    assert env.balance(env.payer) == FUNDED - count * PRICE
    assert next_nonce(env) == start + count


# --- unknown is not failed ---------------------------------------------------------------------


@pytest.mark.django_db
def test_paused_mining_answers_pending_with_the_hash_then_confirms(paused_env: ChainEnv) -> None:
    env, auth = paused_env, paused_env.authorize()
    prepared = settler().prepare(authorization=auth, network=env.network)

    started = time.monotonic()
    outcome = broadcast(env, auth, prepared)
    elapsed = time.monotonic() - started

    assert outcome.status == PENDING
    assert outcome.reason_code == "confirmation_timeout"
    assert outcome.tx_hash == prepared.tx_hash
    assert env.network.confirmation_timeout <= elapsed < env.network.confirmation_timeout + 2
    assert env.balance(env.seller) == 0
    env.node.mine()
    again = broadcast(env, auth, prepared)
    assert again.status == CONFIRMED
    assert again.tx_hash == prepared.tx_hash
    assert env.balance(env.seller) == PRICE


@pytest.mark.django_db
def test_rpc_down_answers_pending_rpc_error_and_sends_nothing(
    direct_env: ChainEnv, closed_rpc_url: str
) -> None:
    env, auth = direct_env, direct_env.authorize()
    prepared = settler().prepare(authorization=auth, network=env.network)
    down = dataclasses.replace(env.network, rpc_url=closed_rpc_url)

    outcome = settler().broadcast(
        authorization=auth, requirements=env.requirements(), network=down, prepared=prepared
    )

    assert isinstance(outcome, SettlementOutcome)  # refused at once: no wait to sleep through
    assert outcome.status == PENDING
    assert outcome.reason_code == "rpc_error"
    assert outcome.tx_hash == prepared.tx_hash
    assert "error" in outcome.evidence
    assert not is_known(env, prepared.tx_hash or "")
    assert env.balance(env.seller) == 0


@pytest.mark.django_db
def test_prepare_with_rpc_down_raises_before_allocating_a_nonce(
    direct_env: ChainEnv, closed_rpc_url: str
) -> None:
    env = direct_env
    down = dataclasses.replace(env.network, rpc_url=closed_rpc_url)

    with pytest.raises(BroadcastNotPrepared) as raised:
        settler().prepare(authorization=env.authorize(), network=down)

    assert raised.value.reason_code == "rpc_error"
    assert not RelayerAccount.objects.filter(network=CAIP2).exists()


@pytest.mark.django_db
def test_broadcast_refuses_bytes_that_are_not_the_prepared_transaction(
    direct_env: ChainEnv,
) -> None:
    env, auth, other = direct_env, direct_env.authorize(), direct_env.authorize()
    prepared = settler().prepare(authorization=auth, network=env.network)
    prepared_other = settler().prepare(authorization=other, network=env.network)
    swapped_bytes = dataclasses.replace(prepared, raw_transaction=prepared_other.raw_transaction)

    with pytest.raises(ValueError, match="hashes to"):
        broadcast(env, auth, swapped_bytes)
    with pytest.raises(ValueError, match="does not carry"):
        broadcast(env, auth, prepared_other)

    assert not is_known(env, prepared.tx_hash or "")
    assert not is_known(env, prepared_other.tx_hash or "")


# --- nonce allocation and healing --------------------------------------------------------------


@pytest.mark.django_db
def test_nonce_allocation_takes_the_higher_of_our_row_and_the_chain(direct_env: ChainEnv) -> None:
    env = direct_env

    def allocate(chain_pending: int) -> int:
        return relayer_nonce_allocate(network=env.network, address=env.relayer.address.lower(),
                                      chain_pending_nonce=chain_pending)  # fmt: skip

    assert [allocate(5), allocate(0), allocate(3), allocate(10)] == [5, 6, 7, 10]
    assert next_nonce(env) == 11  # stored under the checksum address, one row
    assert RelayerAccount.objects.filter(network=CAIP2).count() == 1


@pytest.mark.django_db
def test_dropped_transaction_is_sent_again_byte_for_byte(paused_env: ChainEnv) -> None:
    env, first_auth, later_auth = paused_env, paused_env.authorize(), paused_env.authorize()
    first, first_outcome = settle(env, first_auth)
    env.node.drop_transaction(first.tx_hash or "")
    later, later_outcome = settle(env, later_auth)  # queued behind the gap
    env.node.mine()
    assert (first_outcome.status, later_outcome.status) == (PENDING, PENDING)
    assert later.relayer_nonce == (first.relayer_nonce or 0) + 1
    assert not is_known(env, first.tx_hash or "")
    assert broadcast(env, later_auth, later).status == PENDING  # stalled: nothing mined
    assert env.balance(env.seller) == 0

    actions = heal(env, first, later)

    assert actions == [
        {"nonce": first.relayer_nonce, "action": "rebroadcast", "tx_hash": first.tx_hash}
    ]
    env.node.mine()
    assert broadcast(env, first_auth, first).status == CONFIRMED
    assert broadcast(env, later_auth, later).status == CONFIRMED
    assert env.balance(env.seller) == 2 * PRICE
    # The mined calldata carries the buyer's original signature: nothing was signed again.
    signature = HexBytes(first_auth.signature)
    mined_input = bytes(env.w3.eth.get_transaction(first.tx_hash)["input"])  # type: ignore[arg-type]
    assert signature[:32] in mined_input and signature[32:64] in mined_input
    assert heal(env, first, later) == []  # nothing left to heal


@pytest.mark.django_db
def test_dropped_transaction_that_can_no_longer_execute_is_replaced_by_a_gap_filler(
    paused_env: ChainEnv,
) -> None:
    env, first_auth, later_auth = paused_env, paused_env.authorize(), paused_env.authorize()
    first, _ = settle(env, first_auth)
    env.node.drop_transaction(first.tx_hash or "")
    # Somebody else settles the same authorization meanwhile (anyone may broadcast it).
    wire = first_auth.as_wire()
    send_transfer_with_authorization(env.w3, env.token, env.deployer, wire["authorization"],
                                     wire["signature"], gas=150_000)  # fmt: skip
    later, _ = settle(env, later_auth)
    env.node.mine()
    assert authorization_state(env.w3, env.token, env.payer.address, first_auth.nonce)

    actions = heal(env, first, later)

    assert [(a["nonce"], a["action"]) for a in actions] == [(first.relayer_nonce, "gap_filled")]
    assert actions[0]["tx_hash"] != first.tx_hash
    env.node.mine()
    filler = env.w3.eth.get_transaction(actions[0]["tx_hash"])  # type: ignore[arg-type]
    assert (filler["to"], filler["value"]) == (env.relayer.address, 0)
    assert broadcast(env, later_auth, later).status == CONFIRMED
    # Our own transaction for it can never mine now, yet that is not called a failure: the
    # node's "nonce too low" is told apart from a re-send of ours at once (no receipt wait),
    # and the authorization found used is left to the look-ups (no fresh nonce for it).
    stale = broadcast(env, first_auth, first)
    assert (stale.status, stale.reason_code) == (PENDING, "relayer_nonce_taken")
    assert stale.evidence["authorization_used"] is True
    assert env.balance(env.seller) == 2 * PRICE  # each authorization paid exactly once


@pytest.mark.django_db
def test_nonce_allocated_but_never_sent_is_filled_so_later_transactions_mine(
    gap_env: ChainEnv,
) -> None:
    env, auth = gap_env, gap_env.authorize()
    # Allocated, then the process died before recording or sending anything.
    lost = relayer_nonce_allocate(network=env.network, address=env.relayer.address,
                                  chain_pending_nonce=pending_nonce(env))  # fmt: skip
    prepared, outcome = settle(env, auth)
    assert prepared.relayer_nonce == lost + 1
    assert outcome.status == PENDING  # queued behind the gap

    # A nonce handed out a moment ago may belong to a settlement still on its way: wait.
    assert heal(env, prepared) == []
    assert not env.w3.eth.get_transaction_count(env.relayer.address, "latest") > lost
    later = timezone.now() + timedelta(minutes=2)
    actions = heal(env, prepared, now=later)

    assert [(a["nonce"], a["action"]) for a in actions] == [(lost, "gap_filled")]
    assert broadcast(env, auth, prepared).status == CONFIRMED
    assert env.balance(env.seller) == PRICE
    assert heal(env, prepared, now=later) == []
