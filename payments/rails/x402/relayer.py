"""Our relayer account's nonces: allocate them under a row lock, and heal the gaps.

The relayer pays the gas for direct-mode settlements. Each settlement's transaction is
signed with a nonce handed out here before anything is sent, so concurrent settlements
pipeline instead of racing the node's pending count. A transaction the network drops, or a
nonce handed out to a process that died before sending, leaves a gap that stalls every
later transaction of the account.

Every nonce is handed out on a lease (`nonce_lease()`, 10 s by default): its holder must
record and send its transaction within it. Once the node's pending count has stood at a
gap for a lease, every nonce handed out before the count stopped there has lapsed, and the
next broadcaster (`relayer_gap_close`, before its own send) or the frequent `relayer_heal`
closes the gap: a recorded transaction is sent again byte for byte (an EIP-3009
authorization executes once at most, so this never charges twice), a nonce with nothing
recorded gets a 0-value self-transfer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any, NamedTuple, cast

import rlp
from django.conf import settings
from django.utils import timezone
from eth_account import Account
from eth_account.typed_transactions import TypedTransaction
from eth_typing import HexStr
from eth_utils import keccak
from hexbytes import HexBytes
from web3 import Web3
from web3.exceptions import ContractLogicError, TransactionNotFound, Web3RPCError
from web3.types import TxParams

from payments.chain.token import checksummed
from payments.models import PaymentAttempt, RelayerAccount
from payments.rails.x402.chain import w3_for
from payments.rails.x402.types import NetworkConfig
from payments.signers import TransactionSigner
from payments.sql import relayer_nonce_next

logger = logging.getLogger(__name__)

SELF_TRANSFER_GAS = 21_000  # a plain value transfer to an EOA costs exactly this
# Send errors meaning "this transaction reached the node before" (spellings differ by node).
# "nonce too low" also covers a re-send after it was mined: the receipt wait tells which.
ALREADY_SENT = (
    "already known",
    "already imported",
    "known transaction",
    "already exists",
    "nonce too low",
    "nonce is too low",
    "oldnonce",
)
# Send errors meaning "a transaction already holds this nonce": the same, or another one
# there first.
_NONCE_OCCUPIED = (*ALREADY_SENT, "replacement transaction")

# Nonces closed inside one settlement at most: a longer gap (a node that lost its whole pool,
# a chain reset under a kept database) is closed by the following broadcasts, 8 at a time,
# and by `relayer_heal`, off the buyer's request.
INLINE_GAP_LIMIT = 8

HealAction = dict[str, Any]


class RelayerGapNotFilled(RuntimeError):
    """The node refused our 0-value self-transfer (e.g. the relayer cannot pay the gas)."""


def nonce_lease() -> timedelta:
    """How long a nonce's holder has to record and send its transaction before the nonce
    counts as abandoned (X402_RELAYER_NONCE_LEASE_SECONDS). Allocating, signing, recording
    and sending take milliseconds; a holder that has not sent in this long is gone."""
    return timedelta(seconds=settings.X402_RELAYER_NONCE_LEASE_SECONDS)


class NonceLease(NamedTuple):
    """A nonce handed out, and the lease clock read in the same statement: every nonce
    below `handed_out_by_then` was handed out by `pending_seen_since`, since when the
    node's pending count has stood where the caller saw it."""

    nonce: int
    pending_seen_since: datetime
    handed_out_by_then: int

    def lapsed_below(self, *, chain_pending: int, now: datetime) -> int:
        """Nonces from `chain_pending` up to this one (exclusive) have lapsed leases."""
        if now - self.pending_seen_since < nonce_lease():
            return chain_pending
        return max(chain_pending, self.handed_out_by_then)


def relayer_nonce_allocate(
    *, network: NetworkConfig, address: str, chain_pending_nonce: int
) -> int:
    """Hand out the relayer's next account nonce on `network` (distinct under concurrency)."""
    return relayer_nonce_lease(
        network=network, address=address, chain_pending_nonce=chain_pending_nonce
    ).nonce


def relayer_nonce_lease(
    *, network: NetworkConfig, address: str, chain_pending_nonce: int, now: datetime | None = None
) -> NonceLease:
    """Hand out the relayer's next account nonce on `network` (distinct under concurrency),
    on a lease, and note the node's pending count for the lease clock.

    `chain_pending_nonce` is read by the caller beforehand: no network I/O under the lock.
    The chain wins when it is ahead (the key was used elsewhere, or our row is new).

    One statement: an upsert that takes the row lock, moves the counter and returns the
    nonce, so the lock is held for one statement rather than a transaction's round trips.
    Every replica and worker allocates through this row, so two processes can never hand
    out the same nonce of one key (docs/deployment.md).
    """
    address = checksummed(address)
    # Autocommit: the statement is its own transaction (inside a caller's, it joins that).
    next_nonce, since, by_then = relayer_nonce_next(
        network=network.caip2,
        address=address,
        floor=chain_pending_nonce + 1,
        now=now or timezone.now(),
    )
    return NonceLease(next_nonce - 1, since, by_then)


def relayer_fee_fields(w3: Web3) -> dict[str, int]:
    """Fee fields from the node: EIP-1559 where blocks carry a base fee, else legacy."""
    base_fee = w3.eth.get_block("latest").get("baseFeePerGas")
    if base_fee is None:
        return {"gasPrice": w3.eth.gas_price}
    return dynamic_fee_fields(base_fee=base_fee, priority_fee=w3.eth.max_priority_fee)


def dynamic_fee_fields(*, base_fee: int, priority_fee: int) -> dict[str, int]:
    """EIP-1559 fee fields for a transaction of ours (the same rule as web3's default)."""
    # Twice the base fee survives several full blocks of base-fee growth before it stalls.
    return {"maxFeePerGas": 2 * base_fee + priority_fee, "maxPriorityFeePerGas": priority_fee}


def relayer_heal(
    *,
    network: NetworkConfig,
    w3: Web3,
    account: TransactionSigner,
    known: list[tuple[int, str]],
    now: datetime | None = None,
) -> list[HealAction]:
    """Close the relayer's nonce gaps so later transactions are not stalled.

    `known` holds (relayer_nonce, raw_transaction) of our broadcasts not yet mined. A known
    transaction the node has lost is sent again byte for byte (same hash: the buyer's
    authorization is never signed again); one that can no longer execute is replaced by a
    0-value self-transfer. Nonces handed out but never recorded get a self-transfer too, once
    their lease has lapsed (the node's pending count stood at them for `nonce_lease()`).
    Returns the actions taken. Raises RelayerGapNotFilled, and web3 errors or (on w3_for's
    transport) RpcTransportError on network faults; running it again is safe.
    """
    address = checksummed(account.address)
    latest = w3.eth.get_transaction_count(address, "latest")
    pending = w3.eth.get_transaction_count(address, "pending")
    by_nonce: dict[int, list[str]] = {}
    for nonce, raw in known:
        by_nonce.setdefault(nonce, []).append(raw)
    actions: list[HealAction] = []
    for nonce in sorted(n for n in by_nonce if n >= latest):
        raws = by_nonce[nonce]
        if not any(_node_knows(w3, raw) for raw in raws):
            actions += _resend_or_fill(w3=w3, account=account, network=network,
                                       nonce=nonce, raws=raws)  # fmt: skip
    unsent = _unsent_nonces(network=network, address=account.address, chain_pending=pending,
                            known=by_nonce.keys(), now=now or timezone.now())  # fmt: skip
    for nonce in unsent:
        actions += _fill_gap(w3=w3, account=account, network=network, nonce=nonce)
    return actions


def relayer_gap_close(
    *,
    network: NetworkConfig,
    account: TransactionSigner,
    chain_pending: int,
    allocated: int,
    lapsed_below: int | None = None,
    now: datetime | None = None,
) -> list[HealAction]:
    """Close the gap below a nonce just handed out, before its transaction is sent.

    `chain_pending` is the node's pending count read before `allocated` was handed out, so
    every nonce in between is missing from the node. One that a recorded broadcast of ours
    holds, whose send is over (its attempt has answered, it is older than the lease, or its
    lease has lapsed), was lost (dropped from the pool, undone by a reorg, its sender gone
    before sending): it is sent again byte for byte, or replaced by a 0-value self-transfer
    if it can no longer execute, exactly as `relayer_heal` does; one of a payment recorded
    as failed is only ever replaced (we never move money for a purchase we told was not
    paid). A nonce below `lapsed_below` (`NonceLease.lapsed_below`) with nothing recorded
    was handed out to a process that died before recording: it gets a self-transfer. A
    nonce still within its lease is left to its holder. Call with no transaction open.
    Returns the actions taken; raises what `relayer_heal` raises.
    """
    now = now or timezone.now()
    lapsed = chain_pending if lapsed_below is None else lapsed_below
    nonces = range(chain_pending, min(allocated, chain_pending + INLINE_GAP_LIMIT))
    lost, recorded = _lost_broadcasts(network, account, nonces, now, lapsed_below=lapsed)
    unrecorded = [n for n in nonces if n < lapsed and n not in recorded]
    if not lost and not unrecorded:
        return []
    w3 = w3_for(network)
    actions: list[HealAction] = []
    for nonce in nonces:
        if nonce in lost:
            found = lost[nonce]
            if not any(_node_knows(w3, raw) for raw in found.raws):
                done = _resend_or_fill(w3=w3, account=account, network=network,
                                       nonce=nonce, raws=found.resendable)  # fmt: skip
                actions += [{**action, "attempts": found.attempts} for action in done]
        elif nonce in unrecorded:
            done = _fill_gap(w3=w3, account=account, network=network, nonce=nonce)
            actions += [{**action, "attempts": []} for action in done]
    return actions


@dataclass
class _Lost:
    """Our recorded transactions at one nonce: all, those that may be sent again (not of a
    payment recorded as failed), and their attempts (whose timelines are told)."""

    raws: list[str] = field(default_factory=list)
    resendable: list[str] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)


def _lost_broadcasts(
    network: NetworkConfig,
    account: TransactionSigner,
    nonces: range,
    now: datetime,
    *,
    lapsed_below: int,
) -> tuple[dict[int, _Lost], set[int]]:
    """Our recorded transactions at `nonces` whose own send is over, by relayer nonce; and
    every nonce of `nonces` that a transaction of ours is recorded at."""
    if not nonces:
        return {}, set()
    rows = PaymentAttempt.objects.filter(
        network=network.caip2,
        relayer_nonce__gte=nonces.start,
        relayer_nonce__lt=nonces.stop,
        # An earlier key's rows at these numbers are not read (blank: recorded before the
        # column; `_is_ours` tells those apart).
        relayer_address__in=(account.address, ""),
    ).exclude(raw_transaction="")
    by_nonce: dict[int, _Lost] = {}
    in_flight: set[int] = set()
    lease = nonce_lease()
    for pk, nonce, raw, state, started in rows.values_list(
        "pk", "relayer_nonce", "raw_transaction", "state", "broadcast_started_at"
    ):
        if not _is_ours(raw, account=account, nonce=nonce):
            continue  # signed by an earlier relayer key: it holds none of this key's nonces
        if (
            nonce >= lapsed_below
            and state == PaymentAttempt.State.RECORDED
            and (started is None or now - started < lease)
        ):
            in_flight.add(nonce)  # its first send may not have left yet: not ours to judge
        found = by_nonce.setdefault(nonce, _Lost())
        found.raws.append(raw)
        found.attempts.append(pk)
        if state != PaymentAttempt.State.FAILED:
            found.resendable.append(raw)
    lost = {nonce: found for nonce, found in by_nonce.items() if nonce not in in_flight}
    return lost, set(by_nonce)


def _resend_or_fill(
    *, w3: Web3, account: TransactionSigner, network: NetworkConfig, nonce: int, raws: list[str]
) -> list[HealAction]:
    for raw in raws:
        _check_ours(raw, account=account, nonce=nonce)
        if not _can_execute(w3, raw, sender=account.address):
            continue
        result = _send_raw(w3, raw)
        if result == "sent":
            tx_hash = _tx_hash(raw)
            logger.info("relayer %s: re-sent %s at nonce %s", account.address, tx_hash, nonce)
            return [{"nonce": nonce, "action": "rebroadcast", "tx_hash": tx_hash}]
        if result == "occupied":
            return []  # it reached the node (or was mined) since we looked: no gap
    return _fill_gap(w3=w3, account=account, network=network, nonce=nonce)


def _fill_gap(
    *, w3: Web3, account: TransactionSigner, network: NetworkConfig, nonce: int
) -> list[HealAction]:
    tx: dict[str, Any] = {
        "to": account.address,
        "value": 0,
        "gas": SELF_TRANSFER_GAS,
        "nonce": nonce,
        "chainId": network.chain_id,
        **relayer_fee_fields(w3),
    }
    signed = account.sign_transaction(tx)
    raw = signed.raw
    result = _send_raw(w3, raw)
    if result == "occupied":
        return []  # something we did not know of holds the nonce: it is no gap
    if result == "rejected":
        raise RelayerGapNotFilled(
            f"node rejected the gap filler at nonce {nonce} of {account.address}"
        )
    tx_hash = signed.tx_hash.lower()
    logger.warning("relayer %s: filled nonce gap %s with %s", account.address, nonce, tx_hash)
    return [{"nonce": nonce, "action": "gap_filled", "tx_hash": tx_hash}]


def _unsent_nonces(
    *,
    network: NetworkConfig,
    address: str,
    chain_pending: int,
    known: Iterable[int],
    now: datetime,
) -> list[int]:
    """Nonces at and above the node's pending count, handed out and never recorded, whose
    lease has lapsed. The node's count is noted on the relayer's row like an allocation
    does, so the lease clock runs while no settlement comes."""
    row = RelayerAccount.objects.filter(network=network.caip2, address=address).first()
    if row is None or row.next_nonce <= chain_pending:
        return []
    if row.pending_seen != chain_pending or row.pending_seen_since is None:
        RelayerAccount.objects.filter(pk=row.pk).exclude(pending_seen=chain_pending).update(
            pending_seen=chain_pending, pending_seen_since=now, handed_out_by_then=row.next_nonce
        )
        return []  # the clock starts now: look again once the lease has passed
    if now - row.pending_seen_since < nonce_lease():
        return []  # the latest allocations may still be in flight: look again later
    taken = set(known)
    lapsed = range(chain_pending, row.handed_out_by_then or chain_pending)
    return [n for n in lapsed if n not in taken]


def _send_raw(w3: Web3, raw: str) -> str:
    """Say "sent", "occupied" (a transaction holds the nonce) or "rejected" (node refused)."""
    try:
        w3.eth.send_raw_transaction(HexBytes(raw))
    except Web3RPCError as exc:
        message = str(exc).lower()
        return "occupied" if any(m in message for m in _NONCE_OCCUPIED) else "rejected"
    return "sent"


def _node_knows(w3: Web3, raw: str) -> bool:
    try:
        w3.eth.get_transaction(_tx_hash(raw))
    except TransactionNotFound:
        return False
    return True


def _can_execute(w3: Web3, raw: str, *, sender: str) -> bool:
    """Simulate the call: an authorization used elsewhere or expired reverts here, for free."""
    fields = _decode(raw)
    call: TxParams = {"from": Web3.to_checksum_address(sender), "to": fields["to"],
                      "data": fields["data"], "value": fields["value"]}  # fmt: skip
    try:
        w3.eth.call(call, "latest")
    except ContractLogicError:
        return False
    return True


def _check_ours(raw: str, *, account: TransactionSigner, nonce: int) -> None:
    if not _is_ours(raw, account=account, nonce=nonce):
        raise ValueError(f"raw transaction at nonce {nonce} is not {account.address}'s")


def _is_ours(raw: str, *, account: TransactionSigner, nonce: int) -> bool:
    # A transaction signed by an earlier relayer key may sit at the same nonce number.
    signer, signed_at = _signer_and_nonce(raw)
    return signer.lower() == account.address.lower() and signed_at == nonce


@lru_cache(maxsize=4096)
def _signer_and_nonce(raw: str) -> tuple[str, int]:
    """Who signed a raw transaction, and at which nonce: a signature recovery (an
    elliptic-curve operation), done once per transaction and process. Every broadcast above
    the chain's pending count checks the nonces below its own, so under 64 concurrent
    payments each in-flight transaction was recovered again by every later one (a fifth of
    the paid request's CPU at 2-second blocks, docs/benchmarks.md)."""
    return Account.recover_transaction(raw), int(_decode(raw)["nonce"])


def _decode(raw: str) -> dict[str, Any]:
    """to, data, value and nonce of a signed transaction, typed (EIP-2718) or legacy."""
    payload = bytes(HexBytes(raw))
    if payload[0] <= 0x7F:
        tx = TypedTransaction.from_bytes(HexBytes(payload)).as_dict()
        to, data, value, nonce = tx["to"], tx["data"], tx["value"], tx["nonce"]
    else:
        fields = cast(list[bytes], rlp.decode(payload))
        nonce, value = int.from_bytes(fields[0]), int.from_bytes(fields[4])
        to, data = fields[3], fields[5]
    return {"to": Web3.to_checksum_address(to), "data": HexBytes(data).to_0x_hex(),
            "value": value, "nonce": nonce}  # fmt: skip


def _tx_hash(raw: str) -> HexStr:
    # A transaction's hash is the keccak of its signed encoding, typed or legacy alike.
    return HexStr(HexBytes(keccak(HexBytes(raw))).to_0x_hex())
