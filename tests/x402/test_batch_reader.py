"""BatchChainReader against real anvil nodes: the same outcomes as the live ChainReader, in
O(chunks) round trips. No mocks of the chain; a recording proxy counts the HTTP requests
independently and, in a few tests, corrupts one reply.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
from collections.abc import Sequence
from typing import Any

import pytest

from devtools.test_token import mint
from payments.rails.base import SettlementOutcome, SettlementStatus
from payments.rails.x402.batch import BatchChainReader
from payments.rails.x402.chain import ChainReader, ChainUnavailable
from payments.rails.x402.lookup import settlement_lookup
from payments.rails.x402.types import Authorization, NetworkConfig
from tests.fixtures.anvil import closed_port_url
from tests.x402.chain_env import ChainEnv
from tests.x402.rpc_proxy import RawReply, RpcProxy, random_authorization, random_hash

CONFIRMED = SettlementStatus.CONFIRMED
PENDING = SettlementStatus.PENDING
FAILED = SettlementStatus.FAILED

Items = list[tuple[Authorization, str | None]]


def outcomes(
    batch: BatchChainReader, items: Items, *, now: int, logs_from_block: int = 0
) -> list[SettlementOutcome]:
    return [
        settlement_lookup(
            authorization=authorization,
            network=batch.network,
            tx_hash=tx_hash,
            reader=batch.reader_for(authorization, tx_hash),
            now=now,
            logs_from_block=logs_from_block,
        )
        for authorization, tx_hash in items
    ]


def live_outcomes(
    network: NetworkConfig, items: Sequence[tuple[Authorization, str | None]], **kw: Any
) -> list[SettlementOutcome]:
    reader = ChainReader(network)
    return [
        settlement_lookup(authorization=a, network=network, tx_hash=tx, reader=reader, **kw)
        for a, tx in items
    ]


def assert_same_as_live(
    batch: BatchChainReader, items: Items, *, now: int, logs_from_block: int = 0
) -> list[SettlementOutcome]:
    """Batch outcomes equal the live reader's (same chain state), with no live fallback."""
    before = batch.round_trips
    batched = outcomes(batch, items, now=now, logs_from_block=logs_from_block)
    assert batch.round_trips == before, "a lookup needed a read the prefetch did not make"
    live = live_outcomes(batch.network, items, now=now, logs_from_block=logs_from_block)
    for (authorization, tx_hash), got, want in zip(items, batched, live, strict=True):
        assert got == want, (authorization.nonce, tx_hash)
    return batched


# --- equivalence with the live reader ---------------------------------------------------------


def mined_states(env: ChainEnv) -> dict[str, tuple[Authorization, str | None]]:
    """One item per reconciliation case reachable on an automining node."""
    settled = env.authorization()
    settled_tx = env.settle(settled)
    reverted_tx = env.settle(settled, gas=200_000)  # the same authorization again
    nonce = secrets.token_bytes(32)
    ours = env.authorization(env.sign(nonce=nonce))
    theirs = env.authorization(env.sign(nonce=nonce, to=env.stranger.address))
    env.settle(theirs)
    ours_reverted = env.settle(ours, gas=200_000)
    not_yet = env.authorization(env.sign(valid_after=env.now() + 3600))
    not_yet_reverted = env.settle(not_yet, gas=200_000)
    unused = env.authorization()
    mint_tx = mint(env.w3, env.token, env.deployer, env.stranger.address, 1)
    return {
        "confirmed": (settled, settled_tx),
        "confirmed_found_by_nonce": (settled, None),
        "unknown_hash_settled_elsewhere": (settled, random_hash()),
        "reverted_but_settled": (settled, reverted_tx),
        "used_by_another_transfer": (ours, None),
        "reverted_used_by_another": (ours, ours_reverted),
        "reverted_nonce_unused": (not_yet, not_yet_reverted),
        "unused": (unused, None),
        "unknown_hash_unused": (unused, random_hash()),
        "unrelated_tx": (unused, mint_tx),
        "malformed_hash": (unused, "0xdead"),
        "expired_unused": (env.authorization(env.sign(valid_before=env.now() - 1)), None),
        "upper_case_hash": (settled, "0x" + settled_tx[2:].upper()),
    }


@pytest.mark.parametrize("confirmations", [1, 50])
def test_same_outcomes_as_the_live_reader(chain: ChainEnv, confirmations: int) -> None:
    states = mined_states(chain)
    network = dataclasses.replace(chain.network, confirmations=confirmations)
    batch = BatchChainReader(network)
    items = list(states.values())
    batch.prefetch(items)
    # head + the first reads + the next reads (of every hash that did not settle its
    # payment) + one log query + the receipt of "theirs", named only by a log
    assert batch.round_trips == 1 + 1 + 1 + 1 + 1
    got = dict(zip(states, assert_same_as_live(batch, items, now=chain.now()), strict=True))
    expected = {
        "confirmed": CONFIRMED if confirmations == 1 else PENDING,
        "used_by_another_transfer": FAILED,
        "reverted_nonce_unused": PENDING,
        "expired_unused": FAILED,
        "unused": PENDING,
    }
    assert {name: got[name].status for name in expected} == expected
    assert got["used_by_another_transfer"].reason_code == "authorization_used_elsewhere"
    assert got["confirmed_found_by_nonce"].tx_hash == states["confirmed"][1]


@pytest.mark.parametrize("chunk_size", [1, 2, 5])
def test_small_chunks_same_outcomes(chain: ChainEnv, chunk_size: int) -> None:
    items = list(mined_states(chain).values())
    batch = BatchChainReader(chain.network, chunk_size=chunk_size)
    batch.prefetch(items)
    # Items sharing a nonce or a hash with an earlier chunk may leave a chunk with nothing
    # new to read, which is skipped: the formula is then an upper bound.
    bound = 1 + math.ceil(len(items) / (2 * chunk_size)) + math.ceil(len(items) / chunk_size) + 2
    assert 3 <= batch.round_trips <= bound
    assert_same_as_live(batch, items, now=chain.now())


def test_pending_dropped_and_expired(no_mining_chain: ChainEnv) -> None:
    env = no_mining_chain
    expiring = env.authorization(env.sign(valid_before=env.now() + 60))
    expiring_tx = env.broadcast(expiring)
    dropped = env.authorization()
    dropped_tx = env.broadcast(dropped)
    again = env.authorization()
    first_try = env.broadcast(again)
    for tx_hash in (expiring_tx, dropped_tx, first_try):
        env.node.drop_transaction(tx_hash)
    second_try = env.broadcast(again)
    env.node.increase_time(120)
    env.node.mine()  # mines second_try; `expiring` is now past validBefore on chain
    pending = env.authorization()
    pending_tx = env.broadcast(pending)  # stays in the pool
    items: Items = [
        (expiring, expiring_tx),
        (dropped, dropped_tx),
        (again, first_try),
        (pending, pending_tx),
        (pending, None),
    ]
    batch = BatchChainReader(env.network)
    batch.prefetch(items)
    # head, first reads, next reads (no hash has a receipt), logs (for `again`), receipt of
    # second_try
    assert batch.round_trips == 5
    got = assert_same_as_live(batch, items, now=env.now())
    assert [(o.status, o.reason_code) for o in got] == [
        (FAILED, "authorization_expired_unused"),
        (PENDING, "not_on_chain_yet"),
        (CONFIRMED, ""),
        (PENDING, "not_on_chain_yet"),
        (PENDING, "not_on_chain_yet"),
    ]
    assert got[2].tx_hash == second_try and got[3].evidence["tx_known"] is True


@pytest.mark.parametrize("past_head", [1, 50])
def test_log_range_bound(chain: ChainEnv, past_head: int) -> None:
    authorization = chain.authorization()
    settled_tx = chain.settle(authorization)
    after = chain.w3.eth.get_transaction_receipt(settled_tx)["blockNumber"] + past_head
    chain.node.mine()  # the range [block + 1, head] holds no log of it; +50 is past the head
    items: Items = [(authorization, None), (authorization, random_hash())]
    batch = BatchChainReader(chain.network, logs_from_block=after)
    batch.prefetch(items)
    assert batch.round_trips == (4 if past_head == 1 else 3)  # no query for an empty range
    got = assert_same_as_live(batch, items, now=chain.now(), logs_from_block=after)
    assert {o.reason_code for o in got} == {"authorization_used_untraced"}


def test_reader_methods_match_the_live_reader(chain: ChainEnv) -> None:
    authorization = chain.authorization()
    tx_hash = chain.settle(authorization)
    batch = BatchChainReader(chain.network)
    batch.prefetch([(authorization, tx_hash), (authorization, None)])
    live, cached = chain.reader(), batch.reader_for(authorization, tx_hash)
    head = live.latest_block()
    assert cached.latest_block() == head and cached.prefetched
    args = (authorization.payer, authorization.nonce)
    assert cached.authorization_state(*args, block=head.number) is True
    assert cached.receipt(tx_hash) == live.receipt(tx_hash)
    assert cached.authorization_used_logs(*args, to_block=head.number) == (
        live.authorization_used_logs(*args, to_block=head.number)
    )
    assert batch.round_trips == 3  # all of it from the prefetch (logs: for the None item)
    # Its receipt settled it: the lookup never asks whether the node knows it, so that is
    # read live.
    assert cached.transaction_known(tx_hash) is live.transaction_known(tx_hash) is True
    assert batch.round_trips == 4
    # Reads it did not foresee go live, one request each, same shapes as ChainReader.
    other = random_hash()
    assert cached.receipt(other) is None and cached.transaction_known(other) is False
    # The block before the transfer (the node is shared: block 1 may predate this token).
    before = chain.w3.eth.get_transaction_receipt(tx_hash)["blockNumber"] - 1
    assert cached.authorization_state(*args, block=before) is False
    assert cached.authorization_used_logs(*args, from_block=1) == live.authorization_used_logs(
        *args, from_block=1
    )
    assert cached.balance_of(chain.seller.address) == live.balance_of(chain.seller.address)
    assert batch.round_trips == 4 + 4 + 3  # web3's eth_call sends eth_chainId twice
    with pytest.raises(ValueError):
        cached.authorization_state(authorization.payer, "0x12")


def test_items_not_prefetched_are_read_live(chain: ChainEnv) -> None:
    authorization = chain.authorization()
    tx_hash = chain.settle(authorization)
    batch = BatchChainReader(chain.network)
    batch.prefetch([])
    assert batch.round_trips == 0
    reader = batch.reader_for(authorization, tx_hash)
    assert not reader.prefetched
    assert_same_as_live_fallback(batch, [(authorization, tx_hash)], now=chain.now())
    assert batch.round_trips == 2  # head + receipt


def assert_same_as_live_fallback(batch: BatchChainReader, items: Items, *, now: int) -> None:
    assert outcomes(batch, items, now=now) == live_outcomes(batch.network, items, now=now)


# --- round trips ------------------------------------------------------------------------------


def pending_items(env: ChainEnv, count: int, settled: int) -> tuple[Items, int]:
    """`count` items: `settled` really paid on chain (half asked with their hash, half by
    nonce alone), the rest random unused nonces, half of those with an unknown hash."""
    items: Items = []
    for i in range(settled):
        authorization = env.authorization()
        tx_hash = env.settle(authorization)
        items.append((authorization, tx_hash if i % 2 else None))
    valid_before = env.now() + 600
    for i in range(count - settled):
        items.append(
            (random_authorization(env, valid_before=valid_before), random_hash() if i % 2 else None)
        )
    secrets.SystemRandom().shuffle(items)
    return items, settled


def test_2000_items_in_chunks_of_500(chain: ChainEnv, rpc_proxy: RpcProxy) -> None:
    items, settled = pending_items(chain, 2000, settled=20)
    batch = BatchChainReader(dataclasses.replace(chain.network, rpc_url=rpc_proxy.url))
    batch.prefetch(items)
    # head + ceil(2000 / 1000) batches of first reads (one call each) + ceil(990 / 500)
    # of next reads (two calls for each unknown hash) + one log query + one batch of the
    # receipts it names
    unknown_hashes = sum(1 for _, tx in items if tx) - settled // 2
    assert batch.round_trips == 1 + 2 + 2 + 1 + 1 == len(rpc_proxy.requests)
    methods = rpc_proxy.methods()
    assert methods[0] == "eth_getBlockByNumber" and methods[5] == "eth_getLogs"
    assert sum(len(m) for m in methods[1:3]) == len(items)
    assert sum(len(m) for m in methods[3:5]) == 2 * unknown_hashes
    assert methods[6] == ["eth_getTransactionReceipt"] * (settled // 2)
    head = int(rpc_proxy.requests[5]["params"][0]["toBlock"], 16)
    assert {c["params"][1] for body in rpc_proxy.requests[1:5] for c in body
            if c["method"] == "eth_call"} == {hex(head)}  # fmt: skip
    got = outcomes(batch, items, now=chain.now())
    assert batch.round_trips == 7  # the lookups themselves read nothing
    statuses = [o.status for o in got]
    assert statuses.count(CONFIRMED) == settled
    assert statuses.count(PENDING) == len(items) - settled
    sample = [item for item, o in zip(items, got, strict=True) if o.status == CONFIRMED]
    assert_same_as_live(batch, [*sample, *items[:40]], now=chain.now())


def test_10000_items(chain: ChainEnv, rpc_proxy: RpcProxy) -> None:
    items, settled = pending_items(chain, 10_000, settled=20)
    batch = BatchChainReader(dataclasses.replace(chain.network, rpc_url=rpc_proxy.url))
    started = time.monotonic()
    batch.prefetch(items)
    elapsed = time.monotonic() - started
    unknown_hashes = sum(1 for _, tx in items if tx) - settled // 2
    trips = 1 + math.ceil(10_000 / 1000) + math.ceil(unknown_hashes / 500) + 1 + 1
    assert batch.round_trips == trips == len(rpc_proxy.requests)
    got = outcomes(batch, items, now=chain.now())
    assert batch.round_trips == 23
    assert [o.status for o in got].count(CONFIRMED) == settled
    print(f"\n10k items: {batch.round_trips} round trips, prefetch {elapsed:.2f} s")


# --- failures ---------------------------------------------------------------------------------


def test_closed_port_is_unavailable(chain: ChainEnv) -> None:
    batch = BatchChainReader(dataclasses.replace(chain.network, rpc_url=closed_port_url()))
    with pytest.raises(ChainUnavailable):
        batch.prefetch([(chain.authorization(), None)])
    assert batch.round_trips == 1


def _drop_last(body: Any, reply: Any) -> Any:
    return reply[:-1] if isinstance(body, list) else reply


def _refuse_batches(body: Any, reply: Any) -> Any:
    if isinstance(body, list):
        return {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "too big"}}
    return reply


def _html_for_batches(body: Any, reply: Any) -> Any:
    return RawReply(502, b"<html>502</html>") if isinstance(body, list) else reply


def _truncated_for_batches(body: Any, reply: Any) -> Any:
    return RawReply(200, b'[{"jsonrpc": "2.0", "id": 0, "res') if isinstance(body, list) else reply


@pytest.mark.parametrize(
    "tamper", [_drop_last, _refuse_batches, _html_for_batches, _truncated_for_batches]
)
def test_a_bad_batch_reply_is_unavailable(
    chain: ChainEnv, rpc_proxy: RpcProxy, tamper: Any
) -> None:
    authorization = chain.authorization()
    batch = BatchChainReader(dataclasses.replace(chain.network, rpc_url=rpc_proxy.url))
    batch.prefetch([(authorization, None)])
    kept = batch.reader_for(authorization, None)
    rpc_proxy.tamper = tamper
    with pytest.raises(ChainUnavailable):
        batch.prefetch([(authorization, random_hash())])
    # The failed prefetch left the previous cache in place.
    assert batch.reader_for(authorization, None).prefetched and kept.prefetched


def test_one_bad_call_fails_only_its_item(chain: ChainEnv, rpc_proxy: RpcProxy) -> None:
    bad_state, bad_receipt, good = (chain.authorization() for _ in range(3))
    bad_tx, good_tx = chain.settle(bad_receipt), chain.settle(good)
    items: Items = [(bad_state, None), (bad_receipt, bad_tx), (good, good_tx)]

    def tamper(body: Any, reply: Any) -> Any:
        if not isinstance(body, list):
            return reply
        for call, entry in zip(body, reply, strict=True):
            if call["method"] == "eth_call" and bad_state.nonce[2:] in call["params"][0]["data"]:
                entry.pop("result")
                entry["error"] = {"code": -32000, "message": "header not found"}
            if call["method"] == "eth_getTransactionReceipt" and call["params"] == [bad_tx]:
                entry["result"] = {"garbage": True}
        return reply

    rpc_proxy.tamper = tamper
    batch = BatchChainReader(dataclasses.replace(chain.network, rpc_url=rpc_proxy.url))
    batch.prefetch(items)
    got = outcomes(batch, items, now=chain.now())
    assert [o.reason_code for o in got[:2]] == ["chain_unavailable"] * 2
    assert "header not found" in got[0].evidence["error"]
    assert got[2].status == CONFIRMED
    with pytest.raises(ChainUnavailable):
        batch.reader_for(*items[1]).receipt(bad_tx)
    assert batch.round_trips == 2  # nothing was retried live


def test_a_refused_log_query_fails_only_the_items_needing_logs(
    chain: ChainEnv, rpc_proxy: RpcProxy
) -> None:
    authorization = chain.authorization()
    tx_hash = chain.settle(authorization)
    items: Items = [(authorization, tx_hash), (authorization, None)]

    def tamper(body: Any, reply: Any) -> Any:
        if isinstance(body, dict) and body["method"] == "eth_getLogs":
            return {"jsonrpc": "2.0", "id": body["id"], "error": {"code": -32005,
                    "message": "query exceeds max block range"}}  # fmt: skip
        return reply

    rpc_proxy.tamper = tamper
    batch = BatchChainReader(dataclasses.replace(chain.network, rpc_url=rpc_proxy.url))
    batch.prefetch(items)
    confirmed, by_nonce = outcomes(batch, items, now=chain.now())
    assert confirmed.status == CONFIRMED
    assert (by_nonce.status, by_nonce.reason_code) == (PENDING, "chain_unavailable")
    assert batch.round_trips == 3
