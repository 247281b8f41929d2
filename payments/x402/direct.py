"""Direct mode: our own relayer broadcasts the buyer's EIP-3009 authorization.

`prepare` signs the relayer transaction without sending it, so its hash and raw bytes are
committed before anything leaves the building; `broadcast` sends exactly those bytes (again,
if need be) and waits for them. Network faults never raise: they answer PENDING with the
transaction hash, because unknown is not failed.
"""

from __future__ import annotations

import time
from typing import Any, cast

import requests
from django.core.exceptions import ImproperlyConfigured
from eth_account import Account
from eth_account.signers.local import LocalAccount
from eth_typing import HexStr
from eth_utils import keccak
from hexbytes import HexBytes
from web3 import Web3
from web3.exceptions import TransactionNotFound, Web3Exception, Web3RPCError
from web3.gas_strategies.rpc import rpc_gas_price_strategy
from web3.types import TxParams

from payments.chain.token import build_transfer_with_authorization_tx
from payments.x402.chain import w3_for
from payments.x402.receipts import receipt_poll_delays
from payments.x402.relayer import relayer_nonce_allocate
from payments.x402.types import (
    Authorization,
    NetworkConfig,
    PreparedBroadcast,
    Requirements,
    SettlementOutcome,
    SettlementStatus,
)

# Fixed, not estimated: the signed bytes may be re-sent unchanged long after signing, and an
# estimate is only true of one moment's state. transferWithAuthorization uses ~75k gas (~90k
# when the recipient's balance slot is new); unused gas is refunded, running out is not.
TRANSFER_WITH_AUTHORIZATION_GAS = 150_000
# Send errors meaning "this transaction reached the node before" (spellings differ by node).
# "nonce too low" also covers a re-send after it was mined: the receipt wait tells which.
_ALREADY_SENT = (
    "already known",
    "already imported",
    "known transaction",
    "already exists",
    "nonce too low",
    "nonce is too low",
    "oldnonce",
)
_NETWORK_FAULTS = (Web3Exception, requests.RequestException, OSError)


class BroadcastNotPrepared(Exception):
    """The chain could not be read, so no nonce was allocated and nothing was signed or sent.

    Safe to retry: the authorization is untouched.
    """

    def __init__(self, reason_code: str, detail: str = "") -> None:
        super().__init__(detail or reason_code)
        self.reason_code = reason_code


class DirectSettler:
    """Settler for `mode == "direct"`; stateless, safe to share between threads."""

    def __init__(self, *, poll_interval: float = 0.25, request_timeout: float = 10.0) -> None:
        self.poll_interval = poll_interval
        self.request_timeout = request_timeout

    def prepare(self, *, authorization: Authorization, network: NetworkConfig) -> PreparedBroadcast:
        """Sign (not send) the relayer transaction. Raises BroadcastNotPrepared on a network
        fault, ImproperlyConfigured for a missing relayer key or a node on another chain."""
        account = _relayer_account(network)
        w3 = self._web3(network)
        try:
            tx = _unsigned_transfer(w3, account=account, authorization=authorization,
                                    network=network)  # fmt: skip
            # Read last, just before allocating: the freshest view of our in-flight count.
            chain_pending = w3.eth.get_transaction_count(account.address, "pending")
        except _NETWORK_FAULTS as exc:
            raise BroadcastNotPrepared("rpc_error", str(exc)) from exc
        nonce = relayer_nonce_allocate(
            network=network, address=account.address, chain_pending_nonce=chain_pending
        )
        # eth_account types its input as a plain dict; TxParams is a TypedDict.
        signed = account.sign_transaction(cast(dict[str, Any], {**tx, "nonce": nonce}))
        return PreparedBroadcast(
            tx_hash=signed.hash.to_0x_hex(),
            raw_transaction=signed.raw_transaction.to_0x_hex(),
            relayer_nonce=nonce,
        )

    def broadcast(
        self,
        *,
        authorization: Authorization,
        requirements: Requirements,
        network: NetworkConfig,
        prepared: PreparedBroadcast,
    ) -> SettlementOutcome:
        """Send the prepared bytes and wait up to `network.confirmation_timeout` for them to
        be mined `network.confirmations` deep. Never raises for network faults."""
        tx_hash, raw = _checked_prepared(prepared, authorization)
        w3 = self._web3(network)
        refused = _send(w3, raw)
        if refused is not None:
            return _pending(tx_hash, "rpc_error", network, prepared, error=refused)
        deadline = time.monotonic() + network.confirmation_timeout
        delays = receipt_poll_delays(ceiling=self.poll_interval)
        while True:
            try:
                outcome = _observe(w3, tx_hash, network, prepared)
            except _NETWORK_FAULTS as exc:
                outcome = _pending(tx_hash, "rpc_error", network, prepared, error=repr(exc))
            remaining = deadline - time.monotonic()
            if outcome.status is not SettlementStatus.PENDING or remaining <= 0:
                return outcome
            time.sleep(min(next(delays), remaining))

    def _web3(self, network: NetworkConfig) -> Web3:
        # No hidden retries: the polling loop owns retrying, within the caller's deadline.
        timeout = min(self.request_timeout, max(network.confirmation_timeout, 1.0))
        return w3_for(network, timeout=timeout)


def _relayer_account(network: NetworkConfig) -> LocalAccount:
    if not network.relayer_private_key:
        raise ImproperlyConfigured(f"no relayer key for {network.caip2} (direct mode)")
    account: LocalAccount = Account.from_key(network.relayer_private_key)
    return account


def _unsigned_transfer(
    w3: Web3, *, account: LocalAccount, authorization: Authorization, network: NetworkConfig
) -> TxParams:
    """The relayer's transferWithAuthorization call, fees from the node, no nonce yet."""
    if w3.eth.get_block("latest").get("baseFeePerGas") is None:
        # A chain without EIP-1559: have web3 fill a legacy gasPrice from eth_gasPrice.
        w3.eth.set_gas_price_strategy(rpc_gas_price_strategy)
    wire = authorization.as_wire()
    tx = build_transfer_with_authorization_tx(
        w3, network.token_address, account.address, wire["authorization"], wire["signature"],
        gas=TRANSFER_WITH_AUTHORIZATION_GAS,
    )  # fmt: skip
    if tx.get("chainId") != network.chain_id:
        raise ImproperlyConfigured(
            f"{network.rpc_url} serves chain {tx.get('chainId')}, not {network.caip2}"
        )
    return tx


def _checked_prepared(
    prepared: PreparedBroadcast, authorization: Authorization
) -> tuple[HexStr, str]:
    """The hash and bytes to send. Refuses bytes that do not hash to the recorded hash or do
    not carry this authorization's nonce: a mix-up is a bug, not a network fault."""
    if not prepared.tx_hash or not prepared.raw_transaction:
        raise ValueError("direct broadcast needs a prepared transaction (hash and raw bytes)")
    raw = HexBytes(prepared.raw_transaction)
    actual = HexBytes(keccak(raw)).to_0x_hex()
    if actual != prepared.tx_hash.lower():
        raise ValueError(f"raw transaction hashes to {actual}, not {prepared.tx_hash}")
    # The calldata sits verbatim inside the signed encoding, the 32-byte nonce with it.
    if bytes(HexBytes(authorization.nonce)) not in bytes(raw):
        raise ValueError(f"{actual} does not carry authorization nonce {authorization.nonce}")
    return HexStr(actual), prepared.raw_transaction


def _send(w3: Web3, raw: str) -> str | None:
    """None when the node has (or had) the transaction; otherwise why it would not take it."""
    try:
        w3.eth.send_raw_transaction(HexBytes(raw))
    except Web3RPCError as exc:
        if any(marker in str(exc).lower() for marker in _ALREADY_SENT):
            return None  # sent before (a retry, or the first send's answer was lost)
        return str(exc)
    except _NETWORK_FAULTS as exc:
        return repr(exc)
    return None


def _observe(
    w3: Web3, tx_hash: HexStr, network: NetworkConfig, prepared: PreparedBroadcast
) -> SettlementOutcome:
    """One look at the chain. Looked up afresh each time, so a reorg is noticed."""
    try:
        receipt = w3.eth.get_transaction_receipt(tx_hash)
    except TransactionNotFound:
        return _pending(tx_hash, "confirmation_timeout", network, prepared)
    block = receipt["blockNumber"]
    evidence = {"network": network.caip2, "relayer_nonce": prepared.relayer_nonce,
                "block_number": block, "block_hash": receipt["blockHash"].to_0x_hex(),
                "gas_used": receipt["gasUsed"]}  # fmt: skip
    if receipt["status"] != 1:
        # The caller reconciles by (payer, nonce) before believing this.
        return SettlementOutcome(SettlementStatus.FAILED, tx_hash, "transaction_reverted",
                                 block, evidence)  # fmt: skip
    depth = w3.eth.block_number - block + 1
    evidence["confirmations"] = depth
    if depth < network.confirmations:
        return SettlementOutcome(SettlementStatus.PENDING, tx_hash, "confirmation_timeout",
                                 block, evidence)  # fmt: skip
    return SettlementOutcome(SettlementStatus.CONFIRMED, tx_hash, "", block, evidence)


def _pending(
    tx_hash: str,
    reason_code: str,
    network: NetworkConfig,
    prepared: PreparedBroadcast,
    *,
    error: str = "",
) -> SettlementOutcome:
    evidence: dict[str, Any] = {"network": network.caip2, "relayer_nonce": prepared.relayer_nonce}
    if error:
        evidence["error"] = error
    return SettlementOutcome(SettlementStatus.PENDING, tx_hash, reason_code, evidence=evidence)
