"""The direct settlement's chain traffic as web3.py did it before payments.rails.x402.rpc (commit
94cd2e1): the anchor of bench/rpc_hot_path.py, and the reference tests/x402/test_rpc_client.py
compares the new prepared bytes against.

Kept verbatim in substance: the transaction is built through the token's Contract function
(`build_transaction`: web3's formatters, middlewares, argument binding, eth_chainId, the fee
defaults, a second eth_getBlockByNumber), the pending nonce is read on its own, verification's
three reads go as a web3 batch, and the broadcast sends, then reads the receipt and (when it
succeeded) the head as two calls per look. All of it over web3's HTTPProvider on a
`requests` session per thread and URL (`web3_client`), as then; production's web3 now goes
over payments.rails.x402.rpc's urllib3 transport instead.
"""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import requests
from django.core.exceptions import ImproperlyConfigured
from eth_account import Account
from eth_account.signers.local import LocalAccount
from eth_typing import HexStr
from hexbytes import HexBytes
from web3 import Web3
from web3.exceptions import TransactionNotFound, Web3Exception, Web3RPCError
from web3.gas_strategies.rpc import rpc_gas_price_strategy
from web3.types import TxParams

from payments.chain.token import build_transfer_with_authorization_tx, token_contract
from payments.rails.base import SettlementOutcome, SettlementStatus
from payments.rails.x402.chain import RPC_TIMEOUT_SECONDS, ChainUnavailable
from payments.rails.x402.direct import TRANSFER_WITH_AUTHORIZATION_GAS
from payments.rails.x402.receipts import receipt_poll_delays
from payments.rails.x402.relayer import relayer_nonce_allocate
from payments.rails.x402.types import Authorization, NetworkConfig, PreparedBroadcast

_ALREADY_SENT = ("already known", "already imported", "known transaction", "already exists",
                 "nonce too low", "nonce is too low", "oldnonce")  # fmt: skip
_NETWORK_FAULTS = (Web3Exception, requests.RequestException, OSError)
_clients = threading.local()


def web3_session(rpc_url: str) -> requests.Session:
    """This thread's `requests` session for `rpc_url`, the environment read once (the
    rpc_session of 94cd2e1); the bench mounts its request counter on it."""
    sessions: dict[str, requests.Session] = _clients.__dict__.setdefault("sessions", {})
    session = sessions.get(rpc_url)
    if session is None:
        session = sessions[rpc_url] = requests.Session()
        session.trust_env = False
        session.proxies = dict(requests.utils.get_environ_proxies(rpc_url))
    return session


def web3_client(network: NetworkConfig, *, timeout: float = RPC_TIMEOUT_SECONDS) -> Web3:
    """This thread's Web3 for `network` as w3_for made it at 94cd2e1: web3's HTTPProvider on
    web3_session, retries off."""
    cache: dict[tuple[str, float], Web3] = _clients.__dict__.setdefault("by_url", {})
    client = cache.get((network.rpc_url, timeout))
    if client is None:
        provider = Web3.HTTPProvider(
            network.rpc_url,
            request_kwargs={"timeout": timeout},
            session=web3_session(network.rpc_url),
            exception_retry_configuration=None,
        )
        client = cache[(network.rpc_url, timeout)] = Web3(provider)
    return client


def web3_unsigned_transfer(
    w3: Web3, *, account: LocalAccount, authorization: Authorization, network: NetworkConfig
) -> TxParams:
    """The relayer's transferWithAuthorization call, fees from the node, no nonce yet."""
    if w3.eth.get_block("latest").get("baseFeePerGas") is None:
        w3.eth.set_gas_price_strategy(rpc_gas_price_strategy)
    wire = authorization.as_wire()
    tx = build_transfer_with_authorization_tx(
        w3, network.token_address, account.address, wire["authorization"], wire["signature"],
        gas=TRANSFER_WITH_AUTHORIZATION_GAS,
    )  # fmt: skip
    if tx.get("chainId") != network.chain_id:
        raise ImproperlyConfigured(f"{network.rpc_url} serves chain {tx.get('chainId')}")
    return tx


def web3_sign(account: LocalAccount, tx: TxParams, nonce: int) -> PreparedBroadcast:
    signed = account.sign_transaction(cast(dict[str, Any], {**tx, "nonce": nonce}))
    return PreparedBroadcast(
        tx_hash=signed.hash.to_0x_hex(),
        raw_transaction=signed.raw_transaction.to_0x_hex(),
        relayer_nonce=nonce,
        relayer_address=account.address,
    )


def web3_prepare(*, authorization: Authorization, network: NetworkConfig) -> PreparedBroadcast:
    account: LocalAccount = Account.from_key(network.relayer_private_key)
    w3 = web3_client(network, timeout=max(network.confirmation_timeout, 1.0))
    tx = web3_unsigned_transfer(w3, account=account, authorization=authorization, network=network)
    chain_pending = w3.eth.get_transaction_count(account.address, "pending")
    nonce = relayer_nonce_allocate(
        network=network, address=account.address, chain_pending_nonce=chain_pending
    )
    return web3_sign(account, tx, nonce)


def web3_broadcast(
    *, network: NetworkConfig, prepared: PreparedBroadcast, poll_interval: float = 0.25
) -> SettlementOutcome:
    assert prepared.tx_hash and prepared.raw_transaction
    w3 = web3_client(network, timeout=max(network.confirmation_timeout, 1.0))
    tx_hash = HexStr(prepared.tx_hash)
    try:
        w3.eth.send_raw_transaction(HexBytes(prepared.raw_transaction))
    except Web3RPCError as exc:
        if not any(marker in str(exc).lower() for marker in _ALREADY_SENT):
            return SettlementOutcome(SettlementStatus.PENDING, tx_hash, "rpc_error")
    deadline = time.monotonic() + network.confirmation_timeout
    delays = receipt_poll_delays(ceiling=poll_interval)
    while True:
        try:
            outcome = _web3_observe(w3, tx_hash, network)
        except _NETWORK_FAULTS:
            outcome = SettlementOutcome(SettlementStatus.PENDING, tx_hash, "rpc_error")
        remaining = deadline - time.monotonic()
        if outcome.status is not SettlementStatus.PENDING or remaining <= 0:
            return outcome
        time.sleep(min(next(delays), remaining))


def _web3_observe(w3: Web3, tx_hash: HexStr, network: NetworkConfig) -> SettlementOutcome:
    try:
        receipt = w3.eth.get_transaction_receipt(tx_hash)
    except TransactionNotFound:
        return SettlementOutcome(SettlementStatus.PENDING, tx_hash, "confirmation_timeout")
    block = receipt["blockNumber"]
    evidence = {"block_hash": receipt["blockHash"].to_0x_hex(), "gas_used": receipt["gasUsed"]}
    if receipt["status"] != 1:
        return SettlementOutcome(SettlementStatus.FAILED, tx_hash, "transaction_reverted", block)
    depth = w3.eth.block_number - block + 1
    if depth < network.confirmations:
        return SettlementOutcome(SettlementStatus.PENDING, tx_hash, "confirmation_timeout", block)
    return SettlementOutcome(SettlementStatus.CONFIRMED, tx_hash, "", block, evidence)


def web3_funds_state(network: NetworkConfig, payer: str, nonce: str) -> tuple[bool, int, int]:
    """ChainReader.funds_state as it was: a web3 batch through the token's Contract."""
    w3 = web3_client(network)
    contract = token_contract(w3, network.token_address)
    who, raw_nonce = Web3.to_checksum_address(payer), bytes(HexBytes(nonce))
    try:
        with w3.batch_requests() as batch:
            batch.add(contract.functions.authorizationState(who, raw_nonce))
            batch.add(contract.functions.balanceOf(who))
            batch.add(w3.eth.get_block_number())
            used, balance, head = batch.execute()
    except _NETWORK_FAULTS as exc:
        raise ChainUnavailable(repr(exc)) from exc
    return bool(used), int(cast(Any, balance)), int(cast(Any, head))
