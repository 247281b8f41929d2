"""Chain reads for many x402 payments at once, in few HTTP round trips.

`settlement_lookup` asks a ChainReader a handful of questions per payment; for thousands
of pending payments that is thousands of round trips. BatchChainReader asks them all up
front in JSON-RPC batches, then hands each lookup a reader that answers from that cache:

1. one `eth_getBlockByNumber("latest")`: the snapshot head (number and timestamp);
2. per chunk of 2 x `chunk_size` items, ONE batch request of the first read the lookup
   makes: the receipt of the item's hash, or (no hash) `authorizationState(payer, nonce)`
   pinned to the snapshot number;
3. per chunk of `chunk_size` items whose receipt did not settle them (none, or one that
   moved something else), ONE batch of what the lookup reads next: their
   `authorizationState`, and for a hash with no receipt whether the node knows it;
4. if some used nonce is not settled by its own transaction, ONE `eth_getLogs` of the
   token's AuthorizationUsed events over [logs_from_block, snapshot] for all of them;
5. if those logs name transactions whose receipts are not cached yet, ONE batch of them.

So `round_trips == 1 + ceil(n / 2 chunk_size) + ceil(m / chunk_size) + L + R (+ F)`, n the
distinct (payer, nonce, tx hash) items, m those of step 3 (none when every hash we hold
settled its payment: a backlog of landed transfers costs one call each), L and R each 0
or 1 (steps 4 and 5), F the live fallbacks (any read the prefetch did not foresee: one
HTTP request each). A chunk with nothing new to read is skipped. Chunks of one step are
sent `parallel` at a time (same count of round trips, less waiting on the node).

Consistency: the head is read first, in its own request, and every eth_call and the log
query are pinned to its number; pinning to "latest" inside a batch would not do, since a
node may run the calls of one batch concurrently, across a new block. Receipts cannot be
pinned, exactly as with the live reader (which also reads its head first): one newer than
the head counts 0 confirmations, so the lookup answers "pending" and the next run settles it.

Errors: a refused connection, timeout, HTTP error, non-JSON body, or a reply that is not
one answer per call (an entry with neither a result nor an error object is none) raises
ChainUnavailable from `prefetch` (the job backs off). A JSON-RPC error (or an undecodable
result) for one call is kept, and raised as ChainUnavailable only by the reader that asks
for that value: one bad item does not sink its chunk.

Every request goes through payments.rails.x402.rpc's JsonRpcClient (web3's, for the fallbacks
the lookup does not use, too) on a transport of the reader's own, which counts them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, TypeVar

from eth_abi import decode as abi_decode
from eth_abi import encode as abi_encode
from eth_abi.exceptions import DecodingError
from hexbytes import HexBytes
from web3 import Web3
from web3.types import BlockIdentifier

from payments.chain.token import token_contract
from payments.rails.x402.chain import (
    NONCE_SPENT_TOPICS,
    BlockRef,
    ChainReader,
    ChainUnavailable,
    TransportProvider,
    address_topic,
    is_hash32,
)
from payments.rails.x402.lookup import _settles as settles_transfer  # the lookup's own rule
from payments.rails.x402.rpc import (
    TRANSPORT_FAULTS,
    JsonRpcClient,
    RpcCall,
    RpcError,
    transport_for,
)
from payments.rails.x402.types import Authorization, NetworkConfig

# One batch carries up to 2 calls per item: a node may need a while for 1,000 of them.
BATCH_RPC_TIMEOUT_SECONDS = 30.0
DEFAULT_CHUNK_SIZE = 500
# Batches of one step in flight at once: a node answers them on several cores.
DEFAULT_PARALLEL = 2
# geth refuses more than 1,000 alternatives in one topic position; past that, the
# position is left open and the logs are matched here.
MAX_TOPIC_ALTERNATIVES = 1000

AUTHORIZATION_STATE_SELECTOR = Web3.keccak(text="authorizationState(address,bytes32)")[:4]
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{40}")
_BLOCK_TAGS = frozenset({"latest", "earliest", "pending", "safe", "finalized"})

_T = TypeVar("_T")
_Planned = dict[tuple[str, Any], tuple[str, list[Any]]]  # (kind, key) -> (method, params)
StateKey = tuple[str, str]  # (lower-case payer, lower-case nonce)
LogKey = tuple[str, str]  # (payer as a topic, lower-case nonce): topics 1 and 2 of the event


@dataclass(frozen=True)
class _Failure:
    """A call the node answered with an error (or with a result we cannot decode)."""

    error: str


def _ok(value: _T | _Failure) -> _T:
    if isinstance(value, _Failure):
        raise ChainUnavailable(value.error)
    return value


def _decoded(raw: object, decode: Callable[[Any], _T]) -> _T | _Failure:
    if isinstance(raw, _Failure):
        return raw
    try:
        return decode(raw)
    except (ValueError, TypeError, KeyError, AttributeError, DecodingError) as exc:
        return _Failure(f"undecodable result: {type(exc).__name__}: {exc}")


# --- the calls: a node's refusal is kept, a lost answer sinks the request --------------------

# A batch the node refused as a whole, or no usable answer at all.
_BATCH_FAULTS: tuple[type[Exception], ...] = (RpcError, *TRANSPORT_FAULTS)


def _live(rpc: JsonRpcClient, method: str, params: list[Any]) -> object | _Failure:
    """One call on its own. Raises ChainUnavailable when no answer came back."""
    try:
        return rpc.call(method, params)
    except RpcError as exc:
        return _Failure(f"JSON-RPC error: {exc}")
    except TRANSPORT_FAULTS as exc:
        raise ChainUnavailable(f"{type(exc).__name__}: {exc}") from exc


def _batched(rpc: JsonRpcClient, calls: Sequence[tuple[str, list[Any]]]) -> list[object | _Failure]:
    """Every call in one request, each answer (or the node's refusal of that call) in order.
    Raises ChainUnavailable when the batch as a whole was refused or not answered call for
    call."""
    try:
        answers = rpc.batch([RpcCall(method, tuple(params)) for method, params in calls])
    except _BATCH_FAULTS as exc:
        raise ChainUnavailable(f"{type(exc).__name__}: {exc}") from exc
    return [
        answer.result if answer.error is None else _Failure(f"JSON-RPC error: {answer.error}")
        for answer in answers
    ]


# --- encoding requests and decoding answers (same shapes as ChainReader) ---------------------


def _state_key(authorizer: str, nonce: str) -> StateKey:
    """Raises ValueError for a malformed address or nonce, as ChainReader does."""
    if not is_hash32(nonce):
        raise ValueError(f"expected 0x + 64 hex characters, got {nonce!r}")
    # Checksumming costs a keccak: only for the odd shapes, whose errors it then raises.
    payer = authorizer if _ADDRESS.fullmatch(authorizer) else Web3.to_checksum_address(authorizer)
    return payer.lower(), nonce.lower()


def _log_key(key: StateKey) -> LogKey:
    return address_topic(key[0]), key[1]


def _state_call(token: str, key: StateKey) -> dict[str, str]:
    args = abi_encode(["address", "bytes32"], [key[0], bytes(HexBytes(key[1]))])
    return {"to": token, "data": HexBytes(AUTHORIZATION_STATE_SELECTOR + args).to_0x_hex()}


def _quantity(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise TypeError(f"not a quantity: {value!r}")
    return int(value, 16) if isinstance(value, str) else value


@lru_cache(maxsize=4096)
def _checksummed(address: str) -> str:
    # A keccak per call; a prefetch sees the same few addresses (token, relayer) thousands
    # of times over.
    return Web3.to_checksum_address(address)


def _decode_block(raw: Any) -> BlockRef:
    return BlockRef(number=_quantity(raw["number"]), timestamp=_quantity(raw["timestamp"]))


def _decode_state(raw: Any) -> bool:
    (used,) = abi_decode(["bool"], bytes(HexBytes(raw)))
    return bool(used)


def _decode_log(raw: Any) -> dict[str, Any]:
    return {
        "address": _checksummed(raw["address"]),
        "topics": [HexBytes(t).to_0x_hex() for t in raw["topics"]],
        "data": HexBytes(raw["data"]).to_0x_hex(),
        "logIndex": _quantity(raw["logIndex"]),
        "blockNumber": _quantity(raw["blockNumber"]),
        "transactionHash": HexBytes(raw["transactionHash"]).to_0x_hex(),
    }


def _decode_logs(raw: Any) -> list[dict[str, Any]]:
    # A log flagged `removed` belongs to a block that was reorganised away.
    return [_decode_log(log) for log in raw if not log.get("removed", False)]


def _decode_receipt(raw: Any) -> dict[str, Any] | None:
    if raw is None:  # unknown, or still in the pool
        return None
    return {
        "transactionHash": HexBytes(raw["transactionHash"]).to_0x_hex(),
        "status": _quantity(raw["status"]),
        "blockNumber": _quantity(raw["blockNumber"]),
        "from": _checksummed(raw["from"]),
        "to": _checksummed(raw["to"]) if raw.get("to") else None,
        "logs": [_decode_log(log) for log in raw["logs"]],
        # As ChainReader.receipt: what the settlement cost in gas (the books).
        "gasUsed": _quantity(raw["gasUsed"]),
        "effectiveGasPrice": _quantity(raw.get("effectiveGasPrice") or 0),
    }


def _decode_known(raw: Any) -> bool:
    return raw is not None


def _logs_by_key(logs: list[dict[str, Any]], token: str) -> dict[LogKey, list[dict[str, Any]]]:
    """The logs that spent a nonce of `token` (used, or canceled) by (payer, nonce), each
    list oldest first."""
    grouped: dict[LogKey, list[dict[str, Any]]] = {}
    for log in logs:
        topics = [t.lower() for t in log["topics"]]
        if log["address"] == token and len(topics) >= 3 and topics[0] in NONCE_SPENT_TOPICS:
            grouped.setdefault((topics[1], topics[2]), []).append(log)
    return grouped


def _log_topics(keys: set[LogKey]) -> list[Any]:
    """Topic filter for all `keys` at once; a position with too many alternatives stays open."""
    payers, nonces = sorted({k[0] for k in keys}), sorted({k[1] for k in keys})
    return [
        NONCE_SPENT_TOPICS,
        payers if len(payers) <= MAX_TOPIC_ALTERNATIVES else None,
        nonces if len(nonces) <= MAX_TOPIC_ALTERNATIVES else None,
    ]


# --- the cache of one prefetch -------------------------------------------------------------


@dataclass(frozen=True)
class _Item:
    authorization: Authorization
    key: StateKey
    tx: str | None  # lower-case, or None when absent or malformed (as the lookup does)


@dataclass
class _Cache:
    """What one prefetch learnt, every read as of `head` (None: nothing prefetched)."""

    logs_from_block: int
    head: BlockRef | None = None
    states: dict[StateKey, bool | _Failure] = field(default_factory=dict)
    receipts: dict[str, dict[str, Any] | _Failure | None] = field(default_factory=dict)
    known: dict[str, bool | _Failure] = field(default_factory=dict)
    # None: no log query was needed. Keys the query asked for but found no log of are absent.
    logs: dict[LogKey, list[dict[str, Any]]] | _Failure | None = None
    log_keys: set[LogKey] = field(default_factory=set)  # what the log query filtered for
    items: set[tuple[StateKey, str | None]] = field(default_factory=set)  # every read done

    def store(self, kind: str, key: Any, raw: object) -> None:
        if kind == "state":
            self.states[key] = _decoded(raw, _decode_state)
        elif kind == "receipt":
            self.receipts[key] = _decoded(raw, _decode_receipt)
        else:
            self.known[key] = _decoded(raw, _decode_known)


def _chunks(items: Sequence[_Item], size: int) -> list[Sequence[_Item]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _item(authorization: Authorization, tx_hash: str | None) -> _Item | None:
    try:
        key = _state_key(authorization.payer, authorization.nonce)
    except ValueError:
        return None  # not read: the lookup's own read raises the same ValueError
    tx = tx_hash.lower() if tx_hash and is_hash32(tx_hash) else None
    return _Item(authorization, key, tx)


# --- the batch reader ----------------------------------------------------------------------


class BatchChainReader:
    """Prefetches the chain reads of many settlement lookups; see the module docstring.

    Each item costs up to 2 calls in a batch: keep 2 x chunk_size within the node's batch
    limit (geth's default is 1,000 calls).
    """

    def __init__(
        self,
        network: NetworkConfig,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        logs_from_block: int = 0,
        parallel: int = DEFAULT_PARALLEL,
    ) -> None:
        if chunk_size < 1 or parallel < 1:
            raise ValueError(
                f"chunk_size and parallel must be at least 1: {chunk_size}, {parallel}"
            )
        self.network = network
        self.chunk_size = chunk_size
        self.parallel = parallel
        self.logs_from_block = logs_from_block
        self.token = Web3.to_checksum_address(network.token_address)
        # Its own transport, not the thread's: it counts this reader's requests, and the
        # batches of one step share it from `parallel` threads.
        self._transport = transport_for(
            network.rpc_url, network.rpc_url_fallback, connections=parallel
        )
        self.rpc = JsonRpcClient(self._transport, timeout=BATCH_RPC_TIMEOUT_SECONDS)
        # For the ChainReader methods the lookup does not use: web3, on the same transport.
        self.w3 = Web3(TransportProvider(self._transport, timeout=BATCH_RPC_TIMEOUT_SECONDS))
        self.contract = token_contract(self.w3, self.token)
        self._cache = _Cache(logs_from_block)

    @property
    def round_trips(self) -> int:
        """HTTP requests made so far: prefetches and live fallbacks alike."""
        return self._transport.requests_sent

    def close(self) -> None:
        self._transport.close()

    def prefetch(self, items: Sequence[tuple[Authorization, str | None]]) -> None:
        """Read everything the lookups of `items` will ask; replaces the previous cache.

        Raises ChainUnavailable if a request as a whole fails; the old cache then stays.
        """
        parsed = (_item(authorization, tx_hash) for authorization, tx_hash in items)
        unique = list({(i.key, i.tx): i for i in parsed if i is not None}.values())
        cache = _Cache(self.logs_from_block)
        if unique:
            cache.head = self.snapshot()
            self._run_chunks(
                cache, [self._first_reads(cache, c) for c in _chunks(unique, 2 * self.chunk_size)]
            )
            unsettled = [item for item in unique if self._needs_more(cache, item)]
            self._run_chunks(
                cache, [self._next_reads(cache, c) for c in _chunks(unsettled, self.chunk_size)]
            )
            self._fetch_logs(cache, unique)
            self._fetch_log_receipts(cache)
            cache.items = {(item.key, item.tx) for item in unique}
        self._cache = cache

    def reader_for(self, authorization: Authorization, tx_hash: str | None) -> PrefetchedReader:
        """A ChainReader for the lookup of this item, answering from the last prefetch."""
        return PrefetchedReader(self, self._cache, _item(authorization, tx_hash))

    def snapshot(self) -> BlockRef:
        """One live read of the head block (number and timestamp together)."""
        raw = _live(self.rpc, "eth_getBlockByNumber", ["latest", False])
        return _ok(_decoded(raw, _decode_block))

    def _state_read(self, cache: _Cache, item: _Item) -> tuple[str, list[Any]]:
        assert cache.head is not None
        return "eth_call", [_state_call(self.token, item.key), hex(cache.head.number)]

    def _first_reads(self, cache: _Cache, chunk: Sequence[_Item]) -> _Planned:
        """What the lookup reads first: the receipt of the hash we hold, else the nonce."""
        planned: _Planned = {}
        for item in chunk:
            if item.tx is not None:
                planned["receipt", item.tx] = ("eth_getTransactionReceipt", [item.tx])
            else:
                planned["state", item.key] = self._state_read(cache, item)
        return planned

    def _needs_more(self, cache: _Cache, item: _Item) -> bool:
        """Whether the lookup of `item` reads on after its receipt (see lookup.py)."""
        if item.tx is None:
            return False  # its nonce was read with the first reads
        receipt = cache.receipts.get(item.tx)
        if isinstance(receipt, _Failure):
            return False  # the lookup stops at the unreadable receipt
        return receipt is None or not settles_transfer(receipt, item.authorization, self.network)

    def _next_reads(self, cache: _Cache, chunk: Sequence[_Item]) -> _Planned:
        """For a hash that did not settle its payment: the nonce, and whether the node knows
        a hash it has no receipt for."""
        planned: _Planned = {}
        for item in chunk:
            assert item.tx is not None
            if item.key not in cache.states:
                planned["state", item.key] = self._state_read(cache, item)
            if cache.receipts.get(item.tx) is None and item.tx not in cache.known:
                planned["known", item.tx] = ("eth_getTransactionByHash", [item.tx])
        return planned

    def _run_chunks(self, cache: _Cache, batches: list[_Planned]) -> None:
        """Send the batches of one step, `parallel` at a time; store the answers in order.
        A chunk whose every read an earlier one made (a shared hash or nonce) is skipped."""
        seen: set[tuple[str, Any]] = set()
        todo: list[_Planned] = []
        for planned in batches:
            fresh = {key: call for key, call in planned.items() if key not in seen}
            seen.update(fresh)
            if fresh:
                todo.append(fresh)
        if len(todo) <= 1 or self.parallel == 1:
            for planned in todo:
                self._run(cache, planned)
            return
        with ThreadPoolExecutor(max_workers=self.parallel) as pool:
            answers = list(pool.map(lambda p: _batched(self.rpc, list(p.values())), todo))
        for planned, results in zip(todo, answers, strict=True):
            self._store(cache, planned, results)

    def _run(self, cache: _Cache, planned: _Planned) -> None:
        if not planned:  # everything was already read for an earlier chunk
            return
        self._store(cache, planned, _batched(self.rpc, list(planned.values())))

    @staticmethod
    def _store(cache: _Cache, planned: _Planned, results: list[object | _Failure]) -> None:
        for (kind, key), raw in zip(planned, results, strict=True):
            cache.store(kind, key, raw)

    def _needs_logs(self, cache: _Cache, item: _Item) -> bool:
        """Whether the lookup of `item` will ask for AuthorizationUsed logs (see lookup.py)."""
        if cache.states.get(item.key) is not True:
            return False  # unused, or unreadable: the lookup stops there
        if item.tx is None:
            return True
        receipt = cache.receipts.get(item.tx)
        if isinstance(receipt, _Failure):
            return False
        if receipt is None:
            return not isinstance(cache.known.get(item.tx), _Failure)
        return not settles_transfer(receipt, item.authorization, self.network)

    def _fetch_logs(self, cache: _Cache, items: Sequence[_Item]) -> None:
        assert cache.head is not None
        keys = {_log_key(item.key) for item in items if self._needs_logs(cache, item)}
        if not keys or self.logs_from_block > cache.head.number:
            return  # the lookup skips an empty range too
        params = {
            "address": self.token,
            "fromBlock": hex(self.logs_from_block),
            "toBlock": hex(cache.head.number),
            "topics": _log_topics(keys),
        }
        # An error here is kept like any one call's: only the lookups needing logs see it.
        raw = _live(self.rpc, "eth_getLogs", [params])
        cache.logs = _decoded(raw, lambda logs: _logs_by_key(_decode_logs(logs), self.token))
        cache.log_keys = keys

    def _fetch_log_receipts(self, cache: _Cache) -> None:
        """Receipts of the transactions the logs name: the lookup judges each of them."""
        if not isinstance(cache.logs, dict):
            return
        users = {
            log["transactionHash"].lower()
            for key in cache.log_keys
            for log in cache.logs.get(key, [])
        }
        planned: _Planned = {
            ("receipt", tx): ("eth_getTransactionReceipt", [tx])
            for tx in sorted(users - cache.receipts.keys())
        }
        self._run(cache, planned)


class PrefetchedReader(ChainReader):
    """A ChainReader answering from a BatchChainReader's cache; one live call per miss.

    `prefetched` says whether its item was part of the prefetch. Values are cached by their
    own keys, so a transaction shared by two items was read once for both.
    """

    def __init__(self, batch: BatchChainReader, cache: _Cache, item: _Item | None) -> None:
        # Not ChainReader.__init__: it would build a web3 contract per item. The batch's
        # (on its counted transport) serve the methods not overridden here.
        self.network, self.w3, self.token = batch.network, batch.w3, batch.token
        self._contract = batch.contract
        self._rpc, self._cache = batch.rpc, cache
        self._batch_snapshot = batch.snapshot
        self.prefetched = item is not None and (item.key, item.tx) in cache.items

    def latest_block(self) -> BlockRef:
        if self._cache.head is not None:
            return self._cache.head
        return self._batch_snapshot()

    def authorization_state(
        self, authorizer: str, nonce: str, block: BlockIdentifier = "latest"
    ) -> bool:
        key = _state_key(authorizer, nonce)
        head = self._cache.head
        if head is not None and block == head.number and key in self._cache.states:
            return _ok(self._cache.states[key])
        if not isinstance(block, int) and block not in _BLOCK_TAGS:
            return super().authorization_state(authorizer, nonce, block)  # a hash: web3's job
        at = hex(block) if isinstance(block, int) else block
        raw = _live(self._rpc, "eth_call", [_state_call(self.token, key), at])
        return _ok(_decoded(raw, _decode_state))

    def receipt(self, tx_hash: str) -> dict[str, Any] | None:
        tx = _tx_key(tx_hash)
        if tx in self._cache.receipts:
            return _ok(self._cache.receipts[tx])
        raw = _live(self._rpc, "eth_getTransactionReceipt", [tx])
        return _ok(_decoded(raw, _decode_receipt))

    def transaction_known(self, tx_hash: str) -> bool:
        tx = _tx_key(tx_hash)
        if tx in self._cache.known:
            return _ok(self._cache.known[tx])
        return _ok(_decoded(_live(self._rpc, "eth_getTransactionByHash", [tx]), _decode_known))

    def authorization_used_logs(
        self,
        authorizer: str,
        nonce: str,
        from_block: int = 0,
        to_block: BlockIdentifier = "latest",
    ) -> list[dict[str, Any]]:
        key = _log_key(_state_key(authorizer, nonce))
        cache = self._cache
        head = cache.head
        if (
            cache.logs is not None
            and head is not None
            and (from_block, to_block) == (cache.logs_from_block, head.number)
            and key in cache.log_keys
        ):
            return list(_ok(cache.logs).get(key, []))
        return super().authorization_used_logs(authorizer, nonce, from_block, to_block)


def _tx_key(tx_hash: str) -> str:
    if not is_hash32(tx_hash):
        raise ValueError(f"expected 0x + 64 hex characters, got {tx_hash!r}")
    return tx_hash.lower()


__all__ = [
    "BATCH_RPC_TIMEOUT_SECONDS",
    "DEFAULT_CHUNK_SIZE",
    "BatchChainReader",
    "PrefetchedReader",
]
