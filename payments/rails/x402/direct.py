"""Direct mode: our own relayer broadcasts the buyer's EIP-3009 authorization.

`prepare` signs the relayer transaction without sending it, so its hash and raw bytes are
committed before anything leaves the building; `broadcast` sends exactly those bytes (again,
if need be) and waits for them. Network faults never raise: they answer PENDING with the
transaction hash, because unknown is not failed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import lru_cache
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone
from eth_abi import decode as abi_decode
from eth_abi import encode as abi_encode
from eth_abi.exceptions import DecodingError
from eth_utils import keccak, to_checksum_address
from hexbytes import HexBytes

from core.waits import Awaiting, PollingWait, look_once
from payments.chain.token import transfer_with_authorization_calldata
from payments.rails.base import SettlementOutcome, SettlementStatus, Settling
from payments.rails.x402.chain import AUTHORIZATION_STATE_SELECTOR, is_hash32
from payments.rails.x402.receipts import chain_head_pacing, receipt_poll_delays
from payments.rails.x402.relayer import (
    ALREADY_SENT,
    NonceLease,
    dynamic_fee_fields,
    relayer_gap_close,
    relayer_nonce_lease,
)
from payments.rails.x402.rpc import (
    TRANSPORT_FAULTS,
    JsonRpcClient,
    RpcAnswer,
    RpcCall,
    RpcError,
    RpcReplyInvalid,
    data_bytes,
    quantity,
    rpc_client_for,
)
from payments.rails.x402.types import (
    Authorization,
    NetworkConfig,
    PreparedBroadcast,
    Requirements,
    is_final_at_depth,
)
from payments.signers import SignerUnconfigured, TransactionSigner, relayer_signer

# Fixed, not estimated: the signed bytes may be re-sent unchanged long after signing, and an
# estimate is only true of one moment's state. transferWithAuthorization uses ~75k gas (~90k
# when the recipient's balance slot is new); unused gas is refunded, running out is not.
TRANSFER_WITH_AUTHORIZATION_GAS = 150_000
logger = logging.getLogger(__name__)
# A node's refusal, or no usable answer at all: either way the chain did not say.
_NETWORK_FAULTS: tuple[type[Exception], ...] = (RpcError, *TRANSPORT_FAULTS)
# The same, or an answer that is not what was asked for: the chain did not say either.
_UNREADABLE: tuple[type[Exception], ...] = (
    *_NETWORK_FAULTS,
    DecodingError,
    TypeError,
    KeyError,
    ValueError,
)
# web3's fallback where a node lacks eth_maxPriorityFeePerGas: the mean of the non-zero 5th
# percentile tips of the last 10 blocks, kept within 1 to 1.5 gwei.
_FEE_HISTORY_PARAMS = ("0xa", "pending", [5.0])
_PRIORITY_FEE_BOUNDS = (1_000_000_000, 1_500_000_000)
# (rpc_url, chain_id) pairs whose node said it serves that chain. Asked once per process:
# a URL does not change chains under a running process, and a mismatch is never cached.
_VERIFIED_CHAINS: set[tuple[str, int]] = set()
# Send refusals meaning "the account is past this nonce": our transaction was mined (a
# re-send), or another one took the nonce (`_nonce_taken` tells which).
_NONCE_TOO_LOW = ("nonce too low", "nonce is too low", "oldnonce")
# The reason a broadcast answers when another transaction took its relayer nonce while the
# buyer's authorization is still unused (the rail prepares it again on a fresh nonce).
RELAYER_NONCE_TAKEN = "relayer_nonce_taken"


class BroadcastNotPrepared(Exception):
    """The chain could not be read, so no nonce was allocated and nothing was signed or sent.

    Safe to retry: the authorization is untouched.
    """

    def __init__(self, reason_code: str, detail: str = "") -> None:
        super().__init__(detail or reason_code)
        self.reason_code = reason_code


class DirectSettler:
    """Settler for `mode == "direct"`; stateless, safe to share between threads.

    Talks plain JSON-RPC (payments.rails.x402.rpc), not web3: these few fixed calls run on every
    paid request, and web3's machinery around them was about two thirds of their CPU
    (docs/benchmarks.md, bench/rpc_hot_path.py).
    """

    def __init__(self, *, poll_interval: float = 0.25, request_timeout: float = 10.0) -> None:
        self.poll_interval = poll_interval
        self.request_timeout = request_timeout

    def verify_before_record(
        self, *, authorization: Authorization, requirements: Requirements, network: NetworkConfig
    ) -> None:
        """Our own relayer settles: `verify_payment_funds` has asked the chain already."""

    def prepare(self, *, authorization: Authorization, network: NetworkConfig) -> PreparedBroadcast:
        """Sign (not send) the relayer transaction. Raises BroadcastNotPrepared on a network
        fault, ImproperlyConfigured for a missing relayer key or a node on another chain."""
        signer = relayer_signer_for(network)
        wire = authorization.as_wire()
        data = transfer_with_authorization_calldata(wire["authorization"], wire["signature"])
        try:
            fees, chain_pending = _fees_and_pending_nonce(
                self._rpc(network), address=signer.address, network=network
            )
        except _NETWORK_FAULTS as exc:
            raise BroadcastNotPrepared("rpc_error", str(exc)) from exc
        lease = relayer_nonce_lease(
            network=network, address=signer.address, chain_pending_nonce=chain_pending
        )
        nonce = lease.nonce
        gap_closed = _close_gap_below(network, signer, chain_pending, lease)
        tx: dict[str, Any] = {"to": _checksummed(network.token_address), "value": 0,
                              "data": data, "gas": TRANSFER_WITH_AUTHORIZATION_GAS,
                              "chainId": network.chain_id, "nonce": nonce, **fees}  # fmt: skip
        # Through the signer interface (payments.signers): a KMS or hardware signer may
        # stand in for the environment's key. It signs; nothing is sent before the record.
        signed = signer.sign_transaction(tx)
        return PreparedBroadcast(
            tx_hash=signed.tx_hash.lower(),
            raw_transaction=signed.raw,
            relayer_nonce=nonce,
            relayer_address=signer.address,
            gap_closed=gap_closed,
        )

    def broadcast(
        self,
        *,
        authorization: Authorization,
        requirements: Requirements,
        network: NetworkConfig,
        prepared: PreparedBroadcast,
        wait_until: float | None = None,
    ) -> Settling:
        """Send the prepared bytes and wait up to `network.confirmation_timeout` for them to
        be mined `network.confirmations` deep, and never past `wait_until` (the paying
        request's budget). The bytes are sent whatever is left of it: a wait that ends first
        is PENDING with the hash, for the status URL and reconciliation. Never raises for
        network faults. The wait is returned (core.waits) when the first look is not final."""
        tx_hash, raw = _checked_prepared(prepared, authorization)
        rpc = self._rpc(network)
        refused = _send(rpc, raw)
        if isinstance(refused, _NonceTooLow):
            taken = _nonce_taken(rpc, tx_hash, authorization, network, prepared, refused)
            if taken is not None:
                return _with_gap(taken, prepared)
            refused = None  # ours was sent before (mined or pooled): wait for it
        if refused is not None:
            return _with_gap(
                _pending(tx_hash, "rpc_error", network, prepared, error=refused), prepared
            )

        def look() -> SettlementOutcome:
            try:
                return _observe(rpc, tx_hash, network, prepared)
            except _NETWORK_FAULTS as exc:
                return _pending(tx_hash, "rpc_error", network, prepared, error=repr(exc))

        wait = PollingWait(
            look=look,
            is_done=lambda outcome: outcome.status is not SettlementStatus.PENDING,
            delays=receipt_poll_delays(ceiling=self.poll_interval),
            deadline=wait_deadline(network.confirmation_timeout, wait_until),
            pacing=chain_head_pacing(rpc),  # handed off: one look per block (receipts.py)
        )
        sent = look_once(wait)
        if isinstance(sent, Awaiting):  # the caller sleeps through it (core.waits)
            return sent.map(lambda outcome: _with_gap(outcome, prepared))
        return _with_gap(sent, prepared)

    def _rpc(self, network: NetworkConfig) -> JsonRpcClient:
        # No hidden retries: the polling loop owns retrying, within the caller's deadline.
        timeout = min(self.request_timeout, max(network.confirmation_timeout, 1.0))
        return rpc_client_for(network.rpc_url, timeout=timeout, fallback=network.rpc_url_fallback)


def wait_deadline(timeout: float, wait_until: float | None) -> float:
    """When a settlement's wait ends (time.monotonic()): after `timeout` seconds, or at
    `wait_until` if that comes first."""
    deadline = time.monotonic() + timeout
    return deadline if wait_until is None else min(deadline, wait_until)


def relayer_address(network: NetworkConfig) -> str:
    """Our relayer's address on `network` (checksummed). Raises ImproperlyConfigured when
    no relayer is configured."""
    return str(relayer_signer_for(network).address)


def relayer_signer_for(network: NetworkConfig) -> TransactionSigner:
    """Who signs our relayer's transactions on `network` (payments.signers, built once per
    process and key: deriving an address is an elliptic-curve multiplication). Raises
    ImproperlyConfigured when no relayer is configured."""
    try:
        return relayer_signer(network=network.caip2, key=network.relayer_private_key)
    except SignerUnconfigured as exc:
        raise ImproperlyConfigured(f"no relayer for {network.caip2} (direct mode): {exc}") from exc


def _close_gap_below(
    network: NetworkConfig, account: TransactionSigner, chain_pending: int, lease: NonceLease
) -> tuple[tuple[int, str, str, tuple[int, ...]], ...]:
    """A nonce above the chain's pending count may sit behind a lost broadcast of ours, or
    behind nonces whose holders died before sending: close that gap now (once their leases
    have lapsed), so this transaction does not wait for the heal job behind it."""
    nonce = lease.nonce
    if nonce <= chain_pending:
        return ()  # nothing of ours is missing below it: the usual case, no query, no RPC
    now = timezone.now()
    try:
        actions = relayer_gap_close(
            network=network,
            account=account,
            chain_pending=chain_pending,
            allocated=nonce,
            lapsed_below=lease.lapsed_below(chain_pending=chain_pending, now=now),
            now=now,
        )
    except Exception:  # any fault: this broadcast goes ahead; `relayer_heal` closes it later
        logger.exception(
            "relayer %s: closing the gap below nonce %s failed", account.address, nonce
        )
        return ()
    return tuple((a["nonce"], a["action"], a["tx_hash"], tuple(a["attempts"])) for a in actions)


def _with_gap(outcome: SettlementOutcome, prepared: PreparedBroadcast) -> SettlementOutcome:
    """Name on the outcome (so on the timeline) the gap closed before this broadcast."""
    if not prepared.gap_closed:
        return outcome
    closed = [
        {"relayer_nonce": n, "action": a, "tx_hash": h, "attempts": list(ids)}
        for n, a, h, ids in prepared.gap_closed
    ]
    return replace(outcome, evidence={**outcome.evidence, "relayer_gap_closed": closed})


@lru_cache(maxsize=64)
def _checksummed(address: str) -> str:
    return str(to_checksum_address(address))  # a keccak: once per token, not per call


def _fees_and_pending_nonce(
    rpc: JsonRpcClient, *, address: str, network: NetworkConfig
) -> tuple[dict[str, int], int]:
    """The fee fields and the relayer's pending nonce, in one round trip (with the chain id,
    the first time this URL is used for this chain). Fees as web3 filled them: EIP-1559
    where the latest block has a base fee, else a legacy gasPrice. Both fee answers are
    asked for, and only the one the block calls for is used (a legacy node may refuse the
    other). The pending nonce is the freshest view of our in-flight count."""
    calls = [*FEE_CALLS, RpcCall("eth_getTransactionCount", (address, "pending"))]
    verify_chain = (network.rpc_url, network.chain_id) not in _VERIFIED_CHAINS
    if verify_chain:
        calls.append(RpcCall("eth_chainId"))
    block, priority_fee, gas_price, pending, *chain_id = rpc.batch(calls)
    if verify_chain:
        _check_chain(quantity(chain_id[0].value()), network)
    return fee_fields(rpc, block, priority_fee, gas_price), quantity(pending.value())


# The answers `fee_fields` reads, asked in the caller's own batch.
FEE_CALLS = (
    RpcCall("eth_getBlockByNumber", ("latest", False)),
    RpcCall("eth_maxPriorityFeePerGas"),
    RpcCall("eth_gasPrice"),
)


def fee_fields(
    rpc: JsonRpcClient, block: RpcAnswer, priority_fee: RpcAnswer, gas_price: RpcAnswer
) -> dict[str, int]:
    """The fee fields we sign a relayer transaction with, from the answers to FEE_CALLS:
    EIP-1559 where the latest block has a base fee, else a legacy gasPrice. Both fee answers
    are asked for, and only the one the block calls for is used (a legacy node may refuse
    the other). Raises RpcError or a TRANSPORT_FAULTS exception."""
    header = block.value()
    if not isinstance(header, dict):
        raise RpcReplyInvalid(f"eth_getBlockByNumber: not a block: {str(header)[:200]}")
    if header.get("baseFeePerGas") is None:
        return {"gasPrice": quantity(gas_price.value())}
    try:
        tip = quantity(priority_fee.value())
    except RpcError:
        tip = _fee_history_priority_fee(rpc)
    return dynamic_fee_fields(base_fee=quantity(header["baseFeePerGas"]), priority_fee=tip)


def _check_chain(served: int, network: NetworkConfig) -> None:
    if served != network.chain_id:
        raise ImproperlyConfigured(f"{network.rpc_url} serves chain {served}, not {network.caip2}")
    _VERIFIED_CHAINS.add((network.rpc_url, network.chain_id))


def _fee_history_priority_fee(rpc: JsonRpcClient) -> int:
    history = rpc.call("eth_feeHistory", _FEE_HISTORY_PARAMS)
    try:
        tips = [quantity(block[0]) for block in history["reward"]]
    except (TypeError, KeyError, IndexError) as exc:
        raise RpcReplyInvalid(f"eth_feeHistory: no rewards: {str(history)[:200]}") from exc
    paid = [tip for tip in tips if tip != 0]
    low, high = _PRIORITY_FEE_BOUNDS
    return min(max(round(sum(paid) / (len(paid) or 1)), low), high)


def _checked_prepared(prepared: PreparedBroadcast, authorization: Authorization) -> tuple[str, str]:
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
    return actual, raw.to_0x_hex()


class _NonceTooLow(str):
    """The node's refusal "nonce too low": ours was mined, or another took the nonce."""


def _send(rpc: JsonRpcClient, raw: str) -> str | None:
    """None when the node has (or had) the transaction; otherwise why it would not take it
    (a _NonceTooLow when the account is past its nonce: `_nonce_taken` tells whose)."""
    try:
        rpc.call("eth_sendRawTransaction", (raw,))
    except RpcError as exc:
        message = str(exc)
        if any(marker in message.lower() for marker in _NONCE_TOO_LOW):
            return _NonceTooLow(message)
        if any(marker in message.lower() for marker in ALREADY_SENT):
            return None  # sent before (a retry, or the first send's answer was lost)
        return message
    except TRANSPORT_FAULTS as exc:
        return repr(exc)
    return None


def _nonce_taken(
    rpc: JsonRpcClient,
    tx_hash: str,
    authorization: Authorization,
    network: NetworkConfig,
    prepared: PreparedBroadcast,
    refusal: str,
) -> SettlementOutcome | None:
    """After "nonce too low": None when ours holds the nonce (the node knows it, mined or
    pooled) or the chain cannot tell; else PENDING `relayer_nonce_taken`. Another transaction
    took the nonce in a mined block (a gap closer that found its lease lapsed while we were
    slow), so ours can never land; the evidence says whether the buyer's authorization is
    still unused and the head block's time, for the rail to judge a fresh relayer nonce.
    One round trip, only on this refusal."""
    nonce = prepared.relayer_nonce
    state = abi_encode(
        ["address", "bytes32"], [authorization.payer, bytes(HexBytes(authorization.nonce))]
    )
    call = {
        "to": network.token_address,
        "data": "0x" + (AUTHORIZATION_STATE_SELECTOR + state).hex(),
    }
    calls = [
        RpcCall("eth_getTransactionByHash", (tx_hash,)),
        RpcCall("eth_getTransactionCount", (relayer_address(network), "latest")),
        RpcCall("eth_call", (call, "latest")),
        RpcCall("eth_getBlockByNumber", ("latest", False)),
    ]
    try:
        known, mined_count, used, head = (answer.value() for answer in rpc.batch(calls))
        (used_flag,) = abi_decode(["bool"], data_bytes(used))
        head_timestamp = quantity(head["timestamp"])
        past_nonce = nonce is not None and quantity(mined_count) > nonce
    except _UNREADABLE:
        return None  # the chain did not say: the receipt wait and the look-ups will
    if known is not None or not past_nonce:
        return None
    evidence = {
        "network": network.caip2,
        "relayer_nonce": nonce,
        "error": refusal,
        "authorization_used": bool(used_flag),
        "head_timestamp": head_timestamp,
    }
    return SettlementOutcome(
        SettlementStatus.PENDING, tx_hash, RELAYER_NONCE_TAKEN, evidence=evidence
    )


def _observe(
    rpc: JsonRpcClient, tx_hash: str, network: NetworkConfig, prepared: PreparedBroadcast
) -> SettlementOutcome:
    """One look at the chain: the receipt and the head in one round trip. Looked up afresh
    each time, so a reorg is noticed."""
    receipt_answer, head = rpc.batch(
        [RpcCall("eth_getTransactionReceipt", (tx_hash,)), RpcCall("eth_blockNumber")]
    )
    receipt = receipt_answer.value()
    # No receipt, or (some nodes) one without a block: unknown, or still in the pool.
    if receipt is None or (isinstance(receipt, dict) and receipt.get("blockNumber") is None):
        return _pending(tx_hash, "confirmation_timeout", network, prepared)
    block, status, block_hash, gas_used = _receipt_fields(receipt)
    evidence = {"network": network.caip2, "relayer_nonce": prepared.relayer_nonce,
                "block_number": block, "block_hash": block_hash,
                "gas_used": gas_used, **_gas_payer(receipt)}  # fmt: skip
    if status != 1:
        # The caller reconciles by (payer, nonce) before believing this.
        return SettlementOutcome(SettlementStatus.FAILED, tx_hash, "transaction_reverted",
                                 block, evidence)  # fmt: skip
    depth = quantity(head.value()) - block + 1
    evidence["confirmations"] = depth
    if depth < network.confirmations:
        return SettlementOutcome(SettlementStatus.PENDING, tx_hash, "confirmation_timeout",
                                 block, evidence)  # fmt: skip
    if is_final_at_depth(network, depth):
        # Confirmed at the finality depth: final now, and its receipt is due with the result,
        # which states the block's time (one more look; without it the receipt reads it later).
        evidence["final"] = True
        evidence.update(_block_time(rpc, block))
    return SettlementOutcome(SettlementStatus.CONFIRMED, tx_hash, "", block, evidence)


def _block_time(rpc: JsonRpcClient, block: int) -> dict[str, int]:
    try:
        header = rpc.call("eth_getBlockByNumber", (hex(block), False))
    except _NETWORK_FAULTS:
        return {}
    return {"block_timestamp": quantity(header["timestamp"])} if header else {}


def _receipt_fields(receipt: object) -> tuple[int, int, str, int]:
    """(block number, status, block hash, gas used) of a mined receipt."""
    if not isinstance(receipt, dict) or not is_hash32(receipt.get("blockHash")):
        raise RpcReplyInvalid(f"eth_getTransactionReceipt: not a receipt: {str(receipt)[:200]}")
    return (
        quantity(receipt.get("blockNumber")),
        quantity(receipt.get("status")),
        str(receipt["blockHash"]).lower(),
        quantity(receipt.get("gasUsed")),
    )


def _gas_payer(receipt: object) -> dict[str, Any]:
    """The receipt's price per gas and sender: with gas_used, what the relayer paid (books)."""
    if not isinstance(receipt, dict):
        return {}
    price, sender = receipt.get("effectiveGasPrice"), receipt.get("from")
    if price is None or not isinstance(sender, str):
        return {}
    return {"effective_gas_price": quantity(price), "sent_by": sender.lower()}


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
