"""Read-only chain access for one x402 network.

Every RPC fault (refused connection, timeout, HTTP error, JSON-RPC error, garbage body) is
raised as ChainUnavailable: to the caller it means "the chain did not say", never "no".
Receipts and logs come back as plain dicts of ints and 0x-hex strings, so they can be stored
as evidence as they are.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeVar, cast

from eth_abi import decode as abi_decode
from eth_abi import encode as abi_encode
from eth_abi.exceptions import DecodingError
from eth_typing import BlockNumber, HexStr
from hexbytes import HexBytes
from web3 import Web3
from web3.exceptions import TransactionNotFound, Web3Exception
from web3.providers.base import JSONBaseProvider
from web3.types import BlockIdentifier, FilterParams, LogReceipt, RPCEndpoint, RPCResponse

from payments.chain.token import checksummed, token_contract
from payments.rails.x402.rpc import (
    TRANSPORT_FAULTS,
    FailoverTransport,
    RpcCall,
    RpcError,
    RpcTransport,
    data_bytes,
    quantity,
    rpc_client_for,
    rpc_timeout,
    thread_transport,
)
from payments.rails.x402.types import NetworkConfig

RPC_TIMEOUT_SECONDS = 5.0

AUTHORIZATION_USED_TOPIC = Web3.keccak(text="AuthorizationUsed(address,bytes32)").to_0x_hex()
# EIP-3009's cancelAuthorization (Circle's USDC has it): the authorizer burns the nonce.
AUTHORIZATION_CANCELED_TOPIC = Web3.keccak(
    text="AuthorizationCanceled(address,bytes32)"
).to_0x_hex()
# What spends a nonce: a use, or its authorizer's cancellation.
NONCE_SPENT_TOPICS = [AUTHORIZATION_USED_TOPIC, AUTHORIZATION_CANCELED_TOPIC]
TRANSFER_TOPIC = Web3.keccak(text="Transfer(address,address,uint256)").to_0x_hex()
AUTHORIZATION_STATE_SELECTOR = Web3.keccak(text="authorizationState(address,bytes32)")[:4]
BALANCE_OF_SELECTOR = Web3.keccak(text="balanceOf(address)")[:4]

_HASH32 = re.compile(r"0x[0-9a-fA-F]{64}")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{40}")
_T = TypeVar("_T")


class ChainUnavailable(Exception):
    """The node could not be asked or did not answer: the state is unknown, not negative."""


@dataclass(frozen=True)
class BlockRef:
    number: int
    timestamp: int


class TransportProvider(JSONBaseProvider):
    """web3 over an RpcTransport (payments.rails.x402.rpc): the same urllib3 pool as the plain
    JSON-RPC clients, the same environment, nothing re-sent. web3's own HTTPProvider would
    bring `requests` back, and retry refused connections and timeouts five times with
    backoff by default; a reconciliation read would rather answer "unknown" at once. Single
    calls only: a batch goes through JsonRpcClient.batch, which matches answers by id."""

    def __init__(self, transport: RpcTransport | FailoverTransport, *, timeout: float) -> None:
        super().__init__()
        self.transport = transport
        self._timeout = rpc_timeout(timeout)

    def make_request(self, method: RPCEndpoint, params: Any) -> RPCResponse:
        request = self.encode_rpc_request(method, params)
        return cast(RPCResponse, self.transport.post(request, timeout=self._timeout))


_clients = threading.local()


def w3_for(network: NetworkConfig, *, timeout: float = RPC_TIMEOUT_SECONDS) -> Web3:
    """A Web3 client for `network` with a bounded request time, one per thread and URL.

    Kept per thread: a client (and the token contract built on it) is reused by the next call
    instead of being built again, and no two threads share one. It goes over the thread's
    transport for the URL, with the JSON-RPC clients of the hot path (payments.rails.x402.rpc).
    """
    cache: dict[tuple[str, str, float], Web3] = _clients.__dict__.setdefault("by_url", {})
    key = (network.rpc_url, network.rpc_url_fallback, timeout)
    client = cache.get(key)
    if client is None:
        transport = thread_transport(network.rpc_url, network.rpc_url_fallback)
        client = cache[key] = Web3(TransportProvider(transport, timeout=timeout))
    return client


def is_hash32(value: object) -> bool:
    """True for a 0x + 64 hex string (tx hash, EIP-3009 nonce)."""
    return isinstance(value, str) and _HASH32.fullmatch(value) is not None


@lru_cache(maxsize=4096)
def address_topic(address: str) -> HexStr:
    """An address as an indexed event topic: left-padded to 32 bytes, lower-case hex.
    Cached: checksumming costs a keccak, and a backlog's lookups judge the same few payers'
    and recipients' logs thousands of times over."""
    return HexStr("0x" + "0" * 24 + Web3.to_checksum_address(address)[2:].lower())


# OSError covers a web3 handed in on another transport (requests' faults are OSErrors),
# ValueError a result web3 cannot format, DecodingError one that is no ABI value.
_CHAIN_FAULTS: tuple[type[Exception], ...] = (
    Web3Exception, RpcError, *TRANSPORT_FAULTS, OSError, ValueError, DecodingError,
)  # fmt: skip


@contextmanager
def _rpc() -> Iterator[None]:
    # Inputs are validated before entering this block, so no caller mistake is disguised as
    # an outage.
    try:
        yield
    except _CHAIN_FAULTS as exc:
        raise ChainUnavailable(f"{type(exc).__name__}: {exc}") from exc


def _log_dict(log: LogReceipt | Any) -> dict[str, Any]:
    return {
        "address": Web3.to_checksum_address(log["address"]),
        "topics": [HexBytes(t).to_0x_hex() for t in log["topics"]],
        "data": HexBytes(log["data"]).to_0x_hex(),
        "logIndex": int(log["logIndex"]),
        "blockNumber": int(log["blockNumber"]),
        "transactionHash": HexBytes(log["transactionHash"]).to_0x_hex(),
    }


class ChainReader:
    """Thin, read-only web3 wrapper for one NetworkConfig and its token."""

    def __init__(self, network: NetworkConfig, *, w3: Web3 | None = None) -> None:
        self.network = network
        self.w3 = w3 or w3_for(network)
        self.token = checksummed(network.token_address)
        self._contract = token_contract(self.w3, self.token)

    def _call(self, fn: Callable[[], _T]) -> _T:
        with _rpc():
            return fn()

    # --- token state ---------------------------------------------------------------------

    def authorization_state(
        self, authorizer: str, nonce: str, block: BlockIdentifier = "latest"
    ) -> bool:
        """True once (authorizer, nonce) was used (or canceled) on chain, as of `block`."""
        who, raw_nonce = Web3.to_checksum_address(authorizer), _hash32_bytes(nonce)
        fn = self._contract.functions.authorizationState(who, raw_nonce)
        return bool(self._call(lambda: fn.call(block_identifier=block)))

    def funds_state(self, payer: str, nonce: str) -> tuple[bool, int, int]:
        """(authorization used, balance, head): verification's three reads in one JSON-RPC
        batch, one round trip. The head is read with them, before anything is broadcast, so
        it is a block the transfer cannot land before.

        Plain JSON-RPC, not web3: this runs on every paid request, and web3's batch costs
        several times the CPU of the three calls themselves."""
        who, raw_nonce = _address_hex(payer), _hash32_bytes(nonce)
        state = abi_encode(["address", "bytes32"], [who, raw_nonce])
        calls = [
            RpcCall("eth_call", (self._call_to(AUTHORIZATION_STATE_SELECTOR + state), "latest")),
            RpcCall("eth_call", (self._call_to(BALANCE_OF_SELECTOR + state[:32]), "latest")),
            RpcCall("eth_blockNumber"),
        ]
        rpc = rpc_client_for(
            self.network.rpc_url,
            timeout=RPC_TIMEOUT_SECONDS,
            fallback=self.network.rpc_url_fallback,
        )
        with _rpc():
            used, balance, head = (answer.value() for answer in rpc.batch(calls))
            (used_flag,) = abi_decode(["bool"], data_bytes(used))
            (amount,) = abi_decode(["uint256"], data_bytes(balance))
            return bool(used_flag), int(amount), quantity(head)

    def _call_to(self, data: bytes) -> dict[str, str]:
        return {"to": self.token, "data": "0x" + data.hex()}

    def balance_of(self, holder: str, block: BlockIdentifier = "latest") -> int:
        fn = self._contract.functions.balanceOf(Web3.to_checksum_address(holder))
        return int(self._call(lambda: fn.call(block_identifier=block)))

    # --- blocks and transactions ---------------------------------------------------------

    def block_number(self) -> int:
        return int(self._call(lambda: self.w3.eth.block_number))

    def latest_block(self) -> BlockRef:
        """Number and timestamp of one block, read together (a consistent snapshot)."""
        block = self._call(lambda: self.w3.eth.get_block("latest"))
        return BlockRef(number=int(block["number"]), timestamp=int(block["timestamp"]))

    def block_timestamp(self, number: int) -> int:
        """The timestamp (unix seconds) of block `number`: when it was mined."""
        block = self._call(lambda: self.w3.eth.get_block(number))
        return int(block["timestamp"])

    def finalized_block_number(self) -> int | None:
        """The node's `finalized` block, or None if it has none (it is not tracking an L1, or
        nothing is finalized yet). A node that cannot be asked raises ChainUnavailable."""
        with _rpc():
            try:
                block = self.w3.eth.get_block("finalized")
            except (ValueError, Web3Exception) as exc:
                if "finalized" in str(exc).lower() or "not found" in str(exc).lower():
                    return None
                raise
        number = int(block["number"]) if block else 0
        return number or None  # block 0 (anvil, a fresh chain): it tracks no finality

    def receipt(self, tx_hash: str) -> dict[str, Any] | None:
        """The mined receipt, or None while the node knows no receipt (unknown or pending)."""
        tx = _hash32_hex(tx_hash)
        with _rpc():
            try:
                raw = self.w3.eth.get_transaction_receipt(tx)
            except TransactionNotFound:  # web3 turns the node's `null` into this
                return None
        return {
            "transactionHash": HexBytes(raw["transactionHash"]).to_0x_hex(),
            "status": int(raw["status"]),
            "blockNumber": int(raw["blockNumber"]),
            "from": Web3.to_checksum_address(raw["from"]),
            "to": Web3.to_checksum_address(raw["to"]) if raw.get("to") else None,
            "logs": [_log_dict(log) for log in raw["logs"]],
            "gasUsed": int(raw["gasUsed"]),
            "effectiveGasPrice": int(raw.get("effectiveGasPrice") or 0),
        }

    def transaction_known(self, tx_hash: str) -> bool:
        """True while the node has the transaction, mined or still in its pool."""
        tx = _hash32_hex(tx_hash)
        with _rpc():
            try:
                self.w3.eth.get_transaction(tx)
            except TransactionNotFound:
                return False
        return True

    def authorization_used_logs(
        self,
        authorizer: str,
        nonce: str,
        from_block: int = 0,
        to_block: BlockIdentifier = "latest",
    ) -> list[dict[str, Any]]:
        """AuthorizationUsed (or AuthorizationCanceled) (authorizer, nonce) events of our
        token, oldest first: whatever spent the nonce.

        Both arguments are indexed, so the filter is exact. Public RPCs often cap the block
        range of eth_getLogs: such a refusal surfaces as ChainUnavailable.
        """
        params: FilterParams = {
            "address": self.token,
            "fromBlock": BlockNumber(from_block),
            "toBlock": to_block,
            "topics": [
                NONCE_SPENT_TOPICS,
                address_topic(authorizer),
                _hash32_hex(nonce).lower(),
            ],
        }
        logs = self._call(lambda: self.w3.eth.get_logs(params))
        # A log flagged `removed` belongs to a block that was reorganised away.
        return [_log_dict(log) for log in logs if not log.get("removed", False)]

    def transfer_logs_to(
        self, recipient: str, *, token: str | None = None, from_block: int = 0
    ) -> list[dict[str, Any]]:
        """Transfer(*, recipient, value) events of `token` (ours by default), oldest first.

        The recipient is indexed, so the node filters; the sender and value are judged by the
        caller. A node that caps the range raises ChainUnavailable."""
        params: FilterParams = {
            "address": Web3.to_checksum_address(token or self.token),
            "fromBlock": BlockNumber(from_block),
            "toBlock": "latest",
            "topics": [TRANSFER_TOPIC, None, address_topic(recipient)],
        }
        logs = self._call(lambda: self.w3.eth.get_logs(params))
        return [_log_dict(log) for log in logs if not log.get("removed", False)]

    # --- account nonces (for a relayer) --------------------------------------------------

    def pending_nonce(self, address: str) -> int:
        who = Web3.to_checksum_address(address)
        return int(self._call(lambda: self.w3.eth.get_transaction_count(who, "pending")))

    def latest_nonce(self, address: str) -> int:
        who = Web3.to_checksum_address(address)
        return int(self._call(lambda: self.w3.eth.get_transaction_count(who, "latest")))


def _hash32_hex(value: str) -> HexStr:
    if not is_hash32(value):
        raise ValueError(f"expected 0x + 64 hex characters, got {value!r}")
    return HexStr(value)


def _hash32_bytes(value: str) -> bytes:
    return bytes(HexBytes(_hash32_hex(value)))


def _address_hex(value: str) -> str:
    """A 0x + 40 hex address, lower-cased for the ABI encoder (which checks no checksum
    then: checksumming costs a keccak, and verification checked the payer's already)."""
    if not isinstance(value, str) or not _ADDRESS.fullmatch(value):
        raise ValueError(f"expected an address (0x + 40 hex characters), got {value!r}")
    return value.lower()


__all__ = [
    "AUTHORIZATION_CANCELED_TOPIC",
    "AUTHORIZATION_USED_TOPIC",
    "NONCE_SPENT_TOPICS",
    "TRANSFER_TOPIC",
    "BlockRef",
    "ChainReader",
    "ChainUnavailable",
    "TransportProvider",
    "address_topic",
    "is_hash32",
    "w3_for",
]
