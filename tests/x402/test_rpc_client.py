"""The plain JSON-RPC client of the paid call's hot path (payments.rails.x402.rpc), and the direct
settlement and verification reads built on it, against real anvil nodes. Faults come from a
proxy in front of the real node (tests/x402/rpc_proxy.py); nothing of the node is mocked.
"""

from __future__ import annotations

import dataclasses
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from eth_account.typed_transactions import TypedTransaction
from hexbytes import HexBytes
from web3 import Web3

from bench.web3_settlement import web3_sign, web3_unsigned_transfer
from core.waits import waited_out
from payments.chain.token import (
    TWA_BYTES,
    TWA_VRS,
    token_contract,
    transfer_with_authorization_calldata,
)
from payments.models import RelayerAccount
from payments.rails.base import SettlementStatus
from payments.rails.x402 import direct
from payments.rails.x402.chain import ChainUnavailable, w3_for
from payments.rails.x402.direct import BroadcastNotPrepared, DirectSettler
from payments.rails.x402.rpc import (
    TRANSPORT_FAULTS,
    JsonRpcClient,
    RpcCall,
    RpcConnectionError,
    RpcError,
    RpcHttpError,
    RpcReplyInvalid,
    RpcTransport,
)
from payments.rails.x402.types import Authorization, PreparedBroadcast
from tests.fixtures.anvil import closed_port_url
from tests.x402.chain_env import PRICE, ChainEnv
from tests.x402.rpc_proxy import DROP_CONNECTION, RawReply, RpcProxy

PREPARE_BATCH = [
    "eth_getBlockByNumber",
    "eth_maxPriorityFeePerGas",
    "eth_gasPrice",
    "eth_getTransactionCount",
]


def client(url: str) -> JsonRpcClient:
    return JsonRpcClient(RpcTransport(url), timeout=5.0)


def settler() -> DirectSettler:
    return DirectSettler(poll_interval=0.05)


def prepare(env: ChainEnv, auth: Authorization) -> PreparedBroadcast:
    return settler().prepare(authorization=auth, network=env.network)


def broadcast(env: ChainEnv, auth: Authorization, prepared: PreparedBroadcast) -> Any:
    # Slept through on this thread, as a blocking caller does (core.waits).
    return waited_out(settler().broadcast(authorization=auth, requirements=env.requirements(),
                                          network=env.network, prepared=prepared))  # fmt: skip


def web3_prepared(env: ChainEnv, auth: Authorization, nonce: int) -> PreparedBroadcast:
    """What the web3 path signed before (bench/web3_settlement.py), at the same nonce."""
    w3 = w3_for(env.network, timeout=3.0)
    tx = web3_unsigned_transfer(w3, account=env.relayer, authorization=auth, network=env.network)
    return web3_sign(env.relayer, tx, nonce)


def fields(prepared: PreparedBroadcast) -> dict[str, Any]:
    return dict(TypedTransaction.from_bytes(HexBytes(prepared.raw_transaction or "")).as_dict())


@pytest.fixture
def proxied(direct_env: ChainEnv) -> Iterator[tuple[ChainEnv, RpcProxy]]:
    """`direct_env` reached through a recording proxy, whose URL no chain id is cached for."""
    proxy = RpcProxy(direct_env.node.rpc_url)
    network = dataclasses.replace(direct_env.network, rpc_url=proxy.url)
    direct._VERIFIED_CHAINS.discard((proxy.url, network.chain_id))
    yield dataclasses.replace(direct_env, network=network), proxy
    proxy.close()


def _entry_for(body: Any, reply: Any, method: str) -> dict[str, Any] | None:
    """The reply entry answering `method` in a single call or a batch."""
    pairs = zip(body, reply, strict=True) if isinstance(body, list) else [(body, reply)]
    return next((entry for call, entry in pairs if call["method"] == method), None)


# --- the client --------------------------------------------------------------------------------


def test_batch_answers_are_matched_by_id_whatever_order_they_come_in(
    chain: ChainEnv, rpc_proxy: RpcProxy
) -> None:
    rpc_proxy.tamper = lambda body, reply: reply[::-1] if isinstance(body, list) else reply
    calls = [
        RpcCall("eth_chainId"),
        RpcCall("eth_getBalance", (chain.relayer.address, "latest")),
        RpcCall("eth_getTransactionCount", (chain.deployer.address, "latest")),
        RpcCall("eth_blockNumber"),
    ]

    answers = client(rpc_proxy.url).batch(calls)

    assert [a.call for a in answers] == calls
    chain_id, balance, count, head = (int(a.value(), 16) for a in answers)
    assert chain_id == chain.network.chain_id
    assert balance == chain.w3.eth.get_balance(chain.relayer.address)
    assert count == chain.w3.eth.get_transaction_count(chain.deployer.address)
    assert head == chain.w3.eth.block_number
    assert rpc_proxy.methods() == [[c.method for c in calls]]  # one request


def test_a_refused_call_in_a_batch_fails_only_itself(chain: ChainEnv) -> None:
    refused, head = client(chain.node.rpc_url).batch(
        [RpcCall("eth_noSuchMethod"), RpcCall("eth_blockNumber")]
    )

    assert int(head.value(), 16) == chain.w3.eth.block_number
    with pytest.raises(RpcError) as raised:
        refused.value()
    assert raised.value.method == "eth_noSuchMethod"
    assert raised.value.code == -32601  # the node's own code: method not found
    assert raised.value.message


@pytest.mark.django_db
def test_sending_with_a_used_nonce_surfaces_the_nodes_error_and_message(
    direct_env: ChainEnv,
) -> None:
    env = direct_env
    auth = env.authorize()
    first = prepare(env, auth)
    assert broadcast(env, auth, first).status == SettlementStatus.CONFIRMED
    assert first.relayer_nonce is not None
    reused = env.relayer.sign_transaction(
        {
            "to": env.relayer.address,
            "value": 0,
            "gas": 21_000,
            "gasPrice": env.w3.eth.gas_price,
            "nonce": first.relayer_nonce,  # mined already
            "chainId": env.network.chain_id,
        }
    )

    with pytest.raises(RpcError) as raised:
        client(env.node.rpc_url).call(
            "eth_sendRawTransaction", [reused.raw_transaction.to_0x_hex()]
        )

    assert raised.value.method == "eth_sendRawTransaction"
    assert "nonce too low" in raised.value.message.lower()
    assert isinstance(raised.value.code, int) and raised.value.code != 0
    assert raised.value.message in str(raised.value)


@pytest.mark.django_db
def test_a_refused_broadcast_is_pending_with_the_nodes_message_as_evidence(
    direct_env: ChainEnv,
) -> None:
    env, auth = direct_env, direct_env.authorize()
    prepared = prepare(env, auth)
    env.node.rpc("anvil_setBalance", [env.relayer.address, "0x0"])  # cannot pay the gas

    outcome = broadcast(env, auth, prepared)

    assert (outcome.status, outcome.reason_code) == (SettlementStatus.PENDING, "rpc_error")
    assert outcome.tx_hash == prepared.tx_hash
    assert "insufficient funds" in outcome.evidence["error"].lower()
    assert env.balance(env.seller) == 0


def _drop(body: Any, reply: Any) -> Any:
    return DROP_CONNECTION


def _bad_gateway(body: Any, reply: Any) -> Any:
    return RawReply(502, b"<html>502</html>")


def _truncated(body: Any, reply: Any) -> Any:
    return RawReply(200, b'{"jsonrpc": "2.0", "id": 1, "res')


def _foreign_ids(body: Any, reply: Any) -> Any:
    entries = reply if isinstance(reply, list) else [reply]
    for entry in entries:
        entry["id"] += 1000
    return reply


def _one_answer_missing(body: Any, reply: Any) -> Any:
    return reply[:-1] if isinstance(reply, list) else {"jsonrpc": "2.0", "id": body["id"]}


FAULTS = [_drop, _bad_gateway, _truncated, _foreign_ids, _one_answer_missing]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_lost_or_garbled_answer_is_a_transport_fault(
    chain: ChainEnv, rpc_proxy: RpcProxy, fault: Any
) -> None:
    rpc_proxy.tamper = fault
    rpc = client(rpc_proxy.url)

    with pytest.raises(TRANSPORT_FAULTS) as single:
        rpc.call("eth_blockNumber")
    with pytest.raises(TRANSPORT_FAULTS) as batch:
        rpc.batch([RpcCall("eth_blockNumber"), RpcCall("eth_chainId")])

    assert not isinstance(single.value, RpcError) and not isinstance(batch.value, RpcError)
    if fault is _drop:  # the connection closed unanswered
        assert isinstance(single.value, RpcConnectionError)
    if fault is _bad_gateway:
        assert isinstance(single.value, RpcHttpError) and single.value.status == 502
    if fault in (_foreign_ids, _one_answer_missing):
        assert isinstance(batch.value, RpcReplyInvalid)
    assert len(rpc_proxy.requests) == 2  # nothing sent again behind the caller's back


# --- the transport -----------------------------------------------------------------------------


def test_a_refused_connection_names_the_host_not_the_urls_key() -> None:
    url = closed_port_url() + "/v2/secret-provider-key"

    with pytest.raises(RpcConnectionError) as refused:
        client(url).call("eth_chainId")

    assert "127.0.0.1" in str(refused.value) and "secret-provider-key" not in str(refused.value)


def test_a_connection_the_node_closed_while_idle_is_replaced_before_sending(
    chain: ChainEnv,
) -> None:
    proxy = RpcProxy(chain.node.rpc_url, close_after_reply=True)  # keep-alive promised, broken
    try:
        rpc = client(proxy.url)
        assert int(rpc.call("eth_chainId"), 16) == chain.network.chain_id
        assert proxy.connections_closed.acquire(timeout=5)  # the pooled connection is dead

        assert int(rpc.call("eth_blockNumber"), 16) == chain.w3.eth.block_number

        assert proxy.methods() == ["eth_chainId", "eth_blockNumber"]  # each sent once
        assert rpc.transport.requests_sent == 2
    finally:
        proxy.close()


def test_the_proxy_from_the_environment_is_read_once_and_carries_the_calls(
    chain: ChainEnv, rpc_proxy: RpcProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("http_proxy", "all_proxy", "no_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", rpc_proxy.url)
    monkeypatch.setenv("NO_PROXY", "rpc.local")
    transport = RpcTransport("http://node.invalid:8545/key")  # resolvable only by the proxy
    assert RpcTransport("http://rpc.local:8545/").proxy is None  # NO_PROXY honoured
    monkeypatch.delenv("HTTP_PROXY")  # read when the transport was made, not per call

    rpc = JsonRpcClient(transport, timeout=5.0)

    assert int(rpc.call("eth_chainId"), 16) == chain.network.chain_id
    assert [c.value() for c in rpc.batch([RpcCall("eth_chainId")])] == [hex(chain.node.chain_id)]
    assert rpc_proxy.methods() == ["eth_chainId", ["eth_chainId"]]


def test_an_https_proxy_and_a_ca_bundle_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("https_proxy", "all_proxy", "no_proxy", "ALL_PROXY", "CURL_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "proxy.internal:3128")  # no scheme: http, as requests
    monkeypatch.setenv("NO_PROXY", "rpc.local")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/ssl/corporate.pem")

    proxied = RpcTransport("https://mainnet.example/rpc")

    assert proxied.proxy == "http://proxy.internal:3128"
    assert proxied.ca_bundle == "/etc/ssl/corporate.pem"
    assert RpcTransport("https://rpc.local/v1").proxy is None


@pytest.fixture
def self_signed(tmp_path: Path) -> tuple[Path, ssl.SSLContext]:
    """A certificate for 127.0.0.1 no public root signed, and a server context serving it."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "node.pem", tmp_path / "node.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    return cert, server


def test_tls_trusts_certifi_or_the_ca_bundle_the_environment_names(
    chain: ChainEnv, self_signed: tuple[Path, ssl.SSLContext], monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, server = self_signed
    for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    node = RpcProxy(chain.node.rpc_url, tls=server)
    try:
        with pytest.raises(RpcConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            client(node.url).call("eth_chainId")  # certifi's roots do not know it
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))

        assert int(client(node.url).call("eth_chainId"), 16) == chain.network.chain_id
        assert node.methods() == ["eth_chainId"]
    finally:
        node.close()


# --- verification's reads ----------------------------------------------------------------------


def test_funds_state_is_one_batch_and_reads_what_the_chain_holds(
    chain: ChainEnv, rpc_proxy: RpcProxy
) -> None:
    auth = chain.authorize()
    reader = chain.reader(rpc_url=rpc_proxy.url)

    assert reader.funds_state(auth.payer, auth.nonce) == (
        False, chain.balance(chain.payer), chain.w3.eth.block_number
    )  # fmt: skip
    chain.settle(auth)
    assert reader.funds_state(auth.payer, auth.nonce) == (
        True, chain.balance(chain.payer), chain.w3.eth.block_number
    )  # fmt: skip
    assert rpc_proxy.methods() == [["eth_call", "eth_call", "eth_blockNumber"]] * 2


@pytest.mark.parametrize("fault", [*FAULTS, "refused"])
def test_funds_state_faults_are_chain_unavailable(
    chain: ChainEnv, rpc_proxy: RpcProxy, fault: Any
) -> None:
    def refuse_balance(body: Any, reply: Any) -> Any:
        entry = _entry_for(body, reply, "eth_call")
        assert entry is not None
        entry.pop("result")
        entry["error"] = {"code": -32000, "message": "header not found"}
        return reply

    rpc_proxy.tamper = refuse_balance if fault == "refused" else fault
    auth = chain.authorize()

    with pytest.raises(ChainUnavailable) as raised:
        chain.reader(rpc_url=rpc_proxy.url).funds_state(auth.payer, auth.nonce)
    if fault == "refused":
        assert "header not found" in str(raised.value)


# --- the direct settlement ---------------------------------------------------------------------


@pytest.mark.django_db
def test_a_paid_calls_chain_traffic_is_one_round_trip_per_step(
    proxied: tuple[ChainEnv, RpcProxy],
) -> None:
    env, proxy = proxied
    # Final deeper than it is confirmed (the usual case): settling is confirming only.
    env = dataclasses.replace(env, network=dataclasses.replace(env.network, finality_depth=3))
    auth = env.authorize()

    used, balance, head = env.reader().funds_state(auth.payer, auth.nonce)
    prepared = prepare(env, auth)
    outcome = broadcast(env, auth, prepared)

    assert (used, balance, outcome.status) == (False, env.balance(env.payer) + PRICE,
                                               SettlementStatus.CONFIRMED)  # fmt: skip
    assert "final" not in outcome.evidence
    methods = proxy.methods()
    assert methods[:3] == [
        ["eth_call", "eth_call", "eth_blockNumber"],
        [*PREPARE_BATCH, "eth_chainId"],  # the chain id, once for this URL
        "eth_sendRawTransaction",
    ]
    assert methods[3:] and set(map(tuple, methods[3:])) == {
        ("eth_getTransactionReceipt", "eth_blockNumber")
    }
    assert outcome.block_number is not None and outcome.block_number > head


@pytest.mark.django_db
def test_confirmed_at_the_finality_depth_it_is_final_with_its_blocks_time(
    proxied: tuple[ChainEnv, RpcProxy],
) -> None:
    """A seller confirming at its finality depth is final as it settles: one more read, the
    block's header, so the receipt can state the settlement time (issue 21)."""
    env, proxy = proxied  # confirmations 1, finality depth unset: the same depth
    auth = env.authorize()

    outcome = broadcast(env, auth, prepare(env, auth))

    assert outcome.status == SettlementStatus.CONFIRMED and outcome.evidence["final"] is True
    block = env.w3.eth.get_block(outcome.block_number)
    assert outcome.evidence["block_timestamp"] == block["timestamp"]
    assert proxy.methods()[-1] == "eth_getBlockByNumber"


@pytest.mark.django_db
def test_the_chain_id_is_asked_once_per_url(proxied: tuple[ChainEnv, RpcProxy]) -> None:
    env, proxy = proxied

    first, second = prepare(env, env.authorize()), prepare(env, env.authorize())

    assert proxy.methods() == [[*PREPARE_BATCH, "eth_chainId"], PREPARE_BATCH]
    assert (second.relayer_nonce or 0) == (first.relayer_nonce or 0) + 1


@pytest.mark.django_db
def test_a_node_on_another_chain_is_refused_every_time_and_nothing_is_allocated(
    direct_env: ChainEnv,
) -> None:
    env = direct_env
    elsewhere = dataclasses.replace(env.network, caip2="eip155:84532", chain_id=84532)

    for _ in range(2):  # a refusal is never cached as checked
        with pytest.raises(ImproperlyConfigured, match="serves chain 31337, not eip155:84532"):
            settler().prepare(authorization=env.authorize(), network=elsewhere)

    assert not RelayerAccount.objects.exists()
    assert prepare(env, env.authorize()).relayer_nonce == 0  # the right chain still works


@pytest.mark.django_db
def test_prepared_bytes_are_the_ones_web3_signed(paused_env: ChainEnv) -> None:
    env, auth = paused_env, paused_env.authorize()  # nothing mines: the base fee holds still

    prepared = prepare(env, auth)

    assert prepared == web3_prepared(env, auth, prepared.relayer_nonce or 0)
    tx = fields(prepared)
    assert tx["type"] == 2
    assert tx["gas"] == direct.TRANSFER_WITH_AUTHORIZATION_GAS
    assert (
        tx["maxFeePerGas"]
        == 2 * env.w3.eth.get_block("latest")["baseFeePerGas"] + tx["maxPriorityFeePerGas"]
    )


def _as_legacy_node(body: Any, reply: Any) -> Any:
    """Blocks without a base fee, as a chain before EIP-1559 serves them."""
    entry = _entry_for(body, reply, "eth_getBlockByNumber")
    if entry is not None and entry.get("result"):
        entry["result"].pop("baseFeePerGas", None)
    return reply


@pytest.mark.django_db
def test_a_node_without_a_base_fee_gets_a_legacy_gas_price_transaction(
    proxied: tuple[ChainEnv, RpcProxy],
) -> None:
    env, proxy = proxied
    proxy.tamper = _as_legacy_node
    auth = env.authorize()

    prepared = prepare(env, auth)

    assert prepared == web3_prepared(env, auth, prepared.relayer_nonce or 0)
    raw = HexBytes(prepared.raw_transaction or "")
    assert raw[0] >= 0xC0  # an RLP list: a legacy (EIP-155) transaction, no type byte
    assert broadcast(env, auth, prepared).status == SettlementStatus.CONFIRMED


@pytest.mark.django_db
def test_without_max_priority_fee_the_tip_comes_from_fee_history_as_web3s(
    proxied: tuple[ChainEnv, RpcProxy],
) -> None:
    env, proxy = proxied

    def no_priority_fee_method(body: Any, reply: Any) -> Any:
        entry = _entry_for(body, reply, "eth_maxPriorityFeePerGas")
        if entry is not None:
            entry.pop("result")
            entry["error"] = {"code": -32601, "message": "the method does not exist"}
        return reply

    proxy.tamper = no_priority_fee_method
    auth = env.authorize()

    prepared = prepare(env, auth)

    with pytest.warns(UserWarning, match="eth_feeHistory"):  # web3 says it falls back
        assert prepared == web3_prepared(env, auth, prepared.relayer_nonce or 0)
    assert proxy.methods()[:2] == [[*PREPARE_BATCH, "eth_chainId"], "eth_feeHistory"]


@pytest.mark.django_db
@pytest.mark.parametrize("fault", FAULTS)
def test_prepare_on_a_fault_allocates_no_nonce(
    proxied: tuple[ChainEnv, RpcProxy], fault: Any
) -> None:
    env, proxy = proxied
    proxy.tamper = fault

    with pytest.raises(BroadcastNotPrepared) as raised:
        prepare(env, env.authorize())

    assert raised.value.reason_code == "rpc_error"
    assert not RelayerAccount.objects.exists()


@pytest.mark.django_db
def test_a_send_whose_answer_is_lost_is_pending_then_confirms_once(
    proxied: tuple[ChainEnv, RpcProxy],
) -> None:
    env, proxy = proxied
    auth = env.authorize()
    prepared = prepare(env, auth)
    proxy.tamper = lambda body, reply: (
        DROP_CONNECTION if _entry_for(body, reply, "eth_sendRawTransaction") else reply
    )

    lost = broadcast(env, auth, prepared)

    assert (lost.status, lost.reason_code) == (SettlementStatus.PENDING, "rpc_error")
    assert lost.tx_hash == prepared.tx_hash
    assert "ConnectionError" in lost.evidence["error"]
    assert proxy.methods().count("eth_sendRawTransaction") == 1  # not re-sent by the client
    assert env.balance(env.seller) == PRICE  # the node did get it: only the answer was lost
    proxy.tamper = None
    again = broadcast(env, auth, prepared)  # the same bytes: "already known" / "nonce too low"
    assert (again.status, again.tx_hash) == (SettlementStatus.CONFIRMED, prepared.tx_hash)
    assert env.balance(env.seller) == PRICE


@pytest.mark.django_db
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_while_looking_for_the_receipt_is_pending_not_failed(
    proxied: tuple[ChainEnv, RpcProxy], fault: Any
) -> None:
    env, proxy = proxied
    quick = dataclasses.replace(env.network, confirmation_timeout=0.3)
    env = dataclasses.replace(env, network=quick)
    auth = env.authorize()
    prepared = prepare(env, auth)
    proxy.tamper = lambda body, reply: (
        fault(body, reply) if _entry_for(body, reply, "eth_getTransactionReceipt") else reply
    )

    outcome = broadcast(env, auth, prepared)

    assert (outcome.status, outcome.reason_code) == (SettlementStatus.PENDING, "rpc_error")
    assert outcome.tx_hash == prepared.tx_hash
    assert env.balance(env.seller) == PRICE  # it was mined; the settler just could not see it


@pytest.mark.django_db
def test_a_closed_port_is_a_fault_everywhere(direct_env: ChainEnv) -> None:
    env = direct_env
    down = dataclasses.replace(
        env, network=dataclasses.replace(env.network, rpc_url=closed_port_url())
    )
    auth = env.authorize()

    with pytest.raises(ChainUnavailable):
        down.reader().funds_state(auth.payer, auth.nonce)
    with pytest.raises(BroadcastNotPrepared):
        prepare(down, auth)


# --- the calldata ------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["vrs", "bytes"])
def test_calldata_is_what_webs_contract_function_encodes(chain: ChainEnv, form: str) -> None:
    auth = chain.authorize()
    wire = auth.as_wire()
    sig = HexBytes(auth.signature)
    contract = token_contract(chain.w3, chain.token)
    head = (auth.payer, auth.to, auth.value, auth.valid_after, auth.valid_before,
            bytes(HexBytes(auth.nonce)))  # fmt: skip
    if form == "vrs":
        expected = contract.encode_abi(TWA_VRS, [*head, sig[64], sig[:32], sig[32:64]])
    else:
        expected = contract.encode_abi(TWA_BYTES, [*head, bytes(sig)])

    calldata = transfer_with_authorization_calldata(
        wire["authorization"],
        wire["signature"],
        signature_form=form,  # type: ignore[arg-type]
    )

    assert "0x" + calldata.hex() == expected
    assert Web3.keccak(text=TWA_VRS if form == "vrs" else TWA_BYTES)[:4] == calldata[:4]
