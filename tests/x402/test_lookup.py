"""Reconciling x402 payments from chain evidence, against real anvil nodes (no mocks)."""

from __future__ import annotations

import dataclasses
import http.server
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hexbytes import HexBytes

from devtools.anvil import AnvilNode
from devtools.test_token import mint
from payments.rails.base import SettlementOutcome, SettlementStatus
from payments.rails.x402.chain import ChainReader, ChainUnavailable, w3_for
from payments.rails.x402.lookup import LOOKUP_REASONS, settlement_lookup
from payments.rails.x402.types import Authorization
from tests.fixtures.anvil import closed_port_url
from tests.x402.chain_env import ChainEnv, make_env

CONFIRMED = SettlementStatus.CONFIRMED
PENDING = SettlementStatus.PENDING
FAILED = SettlementStatus.FAILED


def lookup(
    env: ChainEnv,
    authorization: Authorization,
    tx_hash: str | None,
    *,
    now: int | None = None,
    reader: ChainReader | None = None,
    **changes: Any,
) -> SettlementOutcome:
    outcome = settlement_lookup(
        authorization=authorization,
        network=dataclasses.replace(env.network, **changes),
        tx_hash=tx_hash,
        reader=reader or env.reader(**changes),
        now=env.now() if now is None else now,
    )
    assert outcome.status == CONFIRMED or outcome.reason_code in LOOKUP_REASONS
    return outcome


def random_hash() -> str:
    return HexBytes(secrets.token_bytes(32)).to_0x_hex()


# --- confirmed --------------------------------------------------------------------------------


def test_confirmed(chain: ChainEnv) -> None:
    authorization = chain.authorization()
    tx_hash = chain.settle(authorization)
    outcome = lookup(chain, authorization, tx_hash)
    block = chain.w3.eth.get_transaction_receipt(tx_hash)["blockNumber"]
    assert (outcome.status, outcome.tx_hash, outcome.block_number) == (CONFIRMED, tx_hash, block)
    assert outcome.evidence["confirmations"] == 1


def test_confirmations_need_more_blocks(chain: ChainEnv) -> None:
    authorization = chain.authorization()
    tx_hash = chain.settle(authorization)
    waiting = lookup(chain, authorization, tx_hash, confirmations=2)
    assert (waiting.status, waiting.reason_code) == (PENDING, "awaiting_confirmations")
    assert waiting.tx_hash == tx_hash and waiting.block_number is not None
    chain.node.mine()
    done = lookup(chain, authorization, tx_hash, confirmations=2)
    assert (done.status, done.tx_hash, done.block_number) == (
        CONFIRMED,
        tx_hash,
        waiting.block_number,
    )
    assert done.evidence["confirmations"] == 2


def test_unknown_hash_but_settled_by_another_tx(chain: ChainEnv) -> None:
    authorization = chain.authorization()
    settled_by = chain.settle(authorization)
    for asked in (random_hash(), None):
        outcome = lookup(chain, authorization, asked)
        assert (outcome.status, outcome.tx_hash) == (CONFIRMED, settled_by)
        assert outcome.evidence["settled_by"] == settled_by
    assert lookup(chain, authorization, random_hash()).evidence["tx_known"] is False


# --- reverted ---------------------------------------------------------------------------------


def test_reverted_because_another_tx_settled_it(chain: ChainEnv) -> None:
    authorization = chain.authorization()
    settled_by = chain.settle(authorization)
    # The same authorization broadcast again (fixed gas skips estimation): mined, reverted.
    reverted = chain.settle(authorization, gas=200_000)
    assert chain.w3.eth.get_transaction_receipt(reverted)["status"] == 0
    outcome = lookup(chain, authorization, reverted)
    assert (outcome.status, outcome.tx_hash) == (CONFIRMED, settled_by)
    assert outcome.evidence["reverted_tx"] == reverted
    assert outcome.evidence["settled_by"] == settled_by


def test_nonce_used_elsewhere(chain: ChainEnv) -> None:
    # The payer signed two transfers with one nonce; the other one landed first.
    nonce = secrets.token_bytes(32)
    ours = chain.authorization(chain.sign(nonce=nonce))
    theirs = chain.authorization(chain.sign(nonce=nonce, to=chain.stranger.address))
    used_by = chain.settle(theirs)
    reverted = chain.settle(ours, gas=200_000)
    for asked in (reverted, None):
        outcome = lookup(chain, ours, asked)
        assert (outcome.status, outcome.reason_code) == (FAILED, "authorization_used_elsewhere")
        assert outcome.tx_hash == asked
        assert outcome.evidence["used_by"] == [used_by]
    assert lookup(chain, ours, reverted).evidence["reverted_tx"] == reverted


def test_reverted_with_nonce_unused_stays_pending(chain: ChainEnv) -> None:
    # Reverted for a reason that leaves the nonce unused (not yet valid): it can still land.
    now = chain.now()
    authorization = chain.authorization(chain.sign(valid_after=now + 3600))
    reverted = chain.settle(authorization, gas=200_000)
    outcome = lookup(chain, authorization, reverted)
    assert (outcome.status, outcome.reason_code) == (PENDING, "not_on_chain_yet")
    assert outcome.evidence["reverted_tx"] == reverted


def test_used_but_untraceable_is_not_guessed(chain: ChainEnv) -> None:
    # The AuthorizationUsed log lies outside the searched range (as with a pruned or capped
    # node): the nonce is spent, but by what we cannot say.
    authorization = chain.authorization()
    settled_by = chain.settle(authorization)
    after = chain.w3.eth.get_transaction_receipt(settled_by)["blockNumber"] + 1
    chain.node.mine()  # so the range [after, head] is not empty
    outcome = settlement_lookup(
        authorization=authorization, network=chain.network, tx_hash=None,
        reader=chain.reader(), now=chain.now(), logs_from_block=after,
    )  # fmt: skip
    assert (outcome.status, outcome.reason_code) == (PENDING, "authorization_used_untraced")


def test_unrelated_or_malformed_hash_falls_back_to_the_nonce(chain: ChainEnv) -> None:
    authorization = chain.authorization()
    mint_tx = mint(chain.w3, chain.token, chain.deployer, chain.stranger.address, 1)
    unrelated = lookup(chain, authorization, mint_tx)
    assert (unrelated.status, unrelated.reason_code) == (PENDING, "not_on_chain_yet")
    assert unrelated.evidence["unrelated_tx"] == mint_tx
    garbage = lookup(chain, authorization, "0xdead")
    assert (garbage.status, garbage.tx_hash) == (PENDING, None)
    assert garbage.evidence["invalid_tx_hash"] == "0xdead"


# --- not mined, dropped, expired --------------------------------------------------------------


def test_pending_until_mined(no_mining_chain: ChainEnv) -> None:
    env = no_mining_chain
    authorization = env.authorization()
    tx_hash = env.broadcast(authorization)
    outcome = lookup(env, authorization, tx_hash)
    assert (outcome.status, outcome.reason_code) == (PENDING, "not_on_chain_yet")
    assert outcome.tx_hash == tx_hash and outcome.evidence["tx_known"] is True
    env.node.mine()
    assert lookup(env, authorization, tx_hash).status == CONFIRMED


def test_dropped_then_rebroadcast(no_mining_chain: ChainEnv) -> None:
    env = no_mining_chain
    authorization = env.authorization()
    dropped = env.broadcast(authorization)
    env.node.drop_transaction(dropped)
    env.node.mine()
    outcome = lookup(env, authorization, dropped)
    assert (outcome.status, outcome.reason_code) == (PENDING, "not_on_chain_yet")
    assert outcome.evidence["tx_known"] is False
    # The same signed authorization may go out again; asked about the old hash, the
    # lookup finds the new one through the nonce.
    again = env.broadcast(authorization)
    env.node.mine()
    settled = lookup(env, authorization, dropped)
    assert (settled.status, settled.tx_hash) == (CONFIRMED, again)


def test_expired_unused_only_once_the_chain_has_passed_it(no_mining_chain: ChainEnv) -> None:
    env = no_mining_chain
    now = env.now()
    authorization = env.authorization(env.sign(valid_before=now + 60))
    dropped = env.broadcast(authorization)
    env.node.drop_transaction(dropped)
    # Our clock is past validBefore, but the chain's head is not: a block could still carry it.
    lagging = lookup(env, authorization, dropped, now=now + 3600)
    assert (lagging.status, lagging.reason_code) == (PENDING, "not_on_chain_yet")
    env.node.increase_time(120)
    env.node.mine()
    expired = lookup(env, authorization, dropped, now=now + 3600)
    assert (expired.status, expired.reason_code) == (FAILED, "authorization_expired_unused")
    assert expired.tx_hash == dropped


def test_signed_already_expired(chain: ChainEnv) -> None:
    authorization = chain.authorization(chain.sign(valid_before=chain.now() - 1))
    outcome = lookup(chain, authorization, None)
    assert (outcome.status, outcome.reason_code) == (FAILED, "authorization_expired_unused")


# --- the chain cannot be read -----------------------------------------------------------------


def test_chain_down_is_pending(chain: ChainEnv) -> None:
    authorization = chain.authorization()
    tx_hash = chain.settle(authorization)
    down = chain.reader(rpc_url=closed_port_url())
    outcome = lookup(chain, authorization, tx_hash, reader=down)
    assert (outcome.status, outcome.reason_code) == (PENDING, "chain_unavailable")
    assert outcome.tx_hash == tx_hash


def test_node_stopped_mid_life_is_pending() -> None:
    with AnvilNode() as node:
        env = make_env(node)
        authorization = env.authorization(env.sign(valid_before=env.now() - 1))
        reader, now = env.reader(), env.now()
    # Even an authorization that would be provably expired is not FAILED when unread.
    outcome = settlement_lookup(
        authorization=authorization, network=env.network, tx_hash=None, reader=reader, now=now
    )
    assert (outcome.status, outcome.reason_code) == (PENDING, "chain_unavailable")


class _Handler(http.server.BaseHTTPRequestHandler):
    delay = 0.0

    def do_POST(self) -> None:
        time.sleep(self.delay)
        body = b"<html>502 Bad Gateway</html>"
        self.send_response(502 if self.path == "/html" else 200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def broken_rpc() -> Iterator[str]:
    """An HTTP server that answers JSON-RPC with HTML (slowly on /slow)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.parametrize("path", ["/html", "/ok-but-html"])
def test_garbage_answers_are_unavailable(chain: ChainEnv, broken_rpc: str, path: str) -> None:
    reader = chain.reader(rpc_url=broken_rpc + path)
    with pytest.raises(ChainUnavailable):
        reader.block_number()
    outcome = lookup(chain, chain.authorization(), None, reader=reader)
    assert outcome.reason_code == "chain_unavailable"


def test_timeout_is_unavailable(
    chain: ChainEnv, broken_rpc: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_Handler, "delay", 2.0)
    network = dataclasses.replace(chain.network, rpc_url=broken_rpc + "/slow")
    reader = ChainReader(network, w3=w3_for(network, timeout=0.3))
    started = time.monotonic()
    with pytest.raises(ChainUnavailable, match="Timeout"):
        reader.block_number()
    assert time.monotonic() - started < 1.5  # no silent retries


# --- the reader itself ------------------------------------------------------------------------


def test_reader_reads(chain: ChainEnv) -> None:
    reader = chain.reader()
    authorization = chain.authorization()
    assert not reader.authorization_state(authorization.payer, authorization.nonce)
    before = reader.balance_of(chain.seller.address)
    nonce_before = reader.latest_nonce(chain.relayer.address)
    tx_hash = chain.settle(authorization)
    assert reader.authorization_state(authorization.payer, authorization.nonce)
    assert reader.balance_of(chain.seller.address) == before + authorization.value
    assert reader.latest_nonce(chain.relayer.address) == nonce_before + 1
    assert reader.pending_nonce(chain.relayer.address) == nonce_before + 1
    receipt = reader.receipt(tx_hash)
    assert receipt is not None and receipt["status"] == 1
    assert receipt["blockNumber"] <= reader.block_number()
    (log,) = reader.authorization_used_logs(authorization.payer, authorization.nonce)
    assert (log["transactionHash"], log["blockNumber"]) == (tx_hash, receipt["blockNumber"])
    assert reader.transaction_known(tx_hash)
    assert reader.receipt(random_hash()) is None
    assert not reader.transaction_known(random_hash())
    assert reader.authorization_used_logs(chain.payer.address, random_hash()) == []


def test_reader_pending_nonce_counts_the_pool(no_mining_chain: ChainEnv) -> None:
    env = no_mining_chain
    reader = env.reader()
    latest = reader.latest_nonce(env.relayer.address)
    tx_hash = env.broadcast(env.authorization())
    assert reader.pending_nonce(env.relayer.address) == latest + 1
    assert reader.latest_nonce(env.relayer.address) == latest
    assert reader.receipt(tx_hash) is None and reader.transaction_known(tx_hash)
