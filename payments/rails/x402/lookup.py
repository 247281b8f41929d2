"""Reconcile one x402 payment from chain evidence alone.

The answer is CONFIRMED or FAILED only when the chain proves it; everything else is
PENDING with a reason, because unknown is not failed. Evidence is gathered in this order:

1. The transaction we were told about (`tx_hash`): a successful receipt that carries this
   authorization's AuthorizationUsed + Transfer settles it, subject to the confirmation depth.
2. Otherwise (no hash, unknown or pending hash, reverted, or a mined tx that is not this
   transfer) the authorization itself, by (payer, nonce): once used, the AuthorizationUsed
   log names the transaction that used it; while unused, the payment can still land until
   `validBefore` has passed both on our clock and on the chain's.

All chain reads are pinned to one head block, so state, logs and timestamps agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from payments.rails.base import SettlementOutcome, SettlementStatus
from payments.rails.x402.chain import (
    AUTHORIZATION_USED_TOPIC,
    TRANSFER_TOPIC,
    BlockRef,
    ChainReader,
    ChainUnavailable,
    address_topic,
    is_hash32,
)
from payments.rails.x402.types import Authorization, NetworkConfig, is_final_at_depth

CONFIRMED = SettlementStatus.CONFIRMED
PENDING = SettlementStatus.PENDING
FAILED = SettlementStatus.FAILED

# Reason codes of the outcomes this module produces (CONFIRMED carries none).
LOOKUP_REASONS: dict[str, str] = {
    "awaiting_confirmations": "Mined successfully, but not yet at the required depth.",
    "not_on_chain_yet": "The authorization is unused and can still land before validBefore.",
    "authorization_used_untraced": "The nonce is used (or canceled) but no transaction "
    "using it could be read; a person must reconcile it.",
    "authorization_used_elsewhere": "The nonce was used by a transaction that did not pay "
    "this transfer (or canceled by its authorizer); this authorization can never settle.",
    "authorization_expired_unused": "validBefore passed with the nonce unused: the payment "
    "provably never happened.",
    "chain_unavailable": "The node could not be read; nothing is known, ask again later.",
}


def settlement_lookup(
    *,
    authorization: Authorization,
    network: NetworkConfig,
    tx_hash: str | None,
    reader: ChainReader,
    now: int,
    logs_from_block: int = 0,
) -> SettlementOutcome:
    """What the chain says about `authorization` (and the tx we think carried it).

    `logs_from_block` bounds the AuthorizationUsed search (public RPCs cap the range);
    a block at or before the first broadcast is always safe.
    """
    try:
        return _reconcile(authorization, network, tx_hash, reader, now, logs_from_block)
    except ChainUnavailable as exc:
        # A read that failed proves nothing: never FAILED from here.
        return SettlementOutcome(
            PENDING,
            tx_hash=tx_hash or None,
            reason_code="chain_unavailable",
            evidence={"error": str(exc)},
        )


@dataclass(frozen=True)
class _Case:
    """One reconciliation: what we ask about, and the head block every read is pinned to."""

    authorization: Authorization
    network: NetworkConfig
    reader: ChainReader
    head: BlockRef
    tx_hash: str | None
    logs_from_block: int


def _reconcile(
    authorization: Authorization,
    network: NetworkConfig,
    tx_hash: str | None,
    reader: ChainReader,
    now: int,
    logs_from_block: int,
) -> SettlementOutcome:
    head = reader.latest_block()
    evidence: dict[str, Any] = {"head_block": head.number, "head_timestamp": head.timestamp}
    if tx_hash and not is_hash32(tx_hash):
        evidence["invalid_tx_hash"] = tx_hash  # e.g. a facilitator's garbage: ignore it
    tx_hash = tx_hash.lower() if tx_hash and is_hash32(tx_hash) else None
    case = _Case(authorization, network, reader, head, tx_hash, logs_from_block)
    if tx_hash:
        receipt = reader.receipt(tx_hash)
        if receipt is None:
            # Unknown or still pooled: only the nonce can tell more.
            evidence["tx_known"] = reader.transaction_known(tx_hash)
        elif _settles(receipt, authorization, network):
            return _by_depth(case, receipt, evidence)
        elif receipt["status"] == 0:
            evidence["reverted_tx"] = tx_hash
        else:
            evidence["unrelated_tx"] = tx_hash  # mined, but it did not move this payment
    return _by_nonce(case, now, evidence)


def _by_nonce(case: _Case, now: int, evidence: dict[str, Any]) -> SettlementOutcome:
    auth, head = case.authorization, case.head
    if case.reader.authorization_state(auth.payer, auth.nonce, block=head.number):
        return _by_used_nonce(case, evidence)
    # The token needs block.timestamp < validBefore. Blocks only move forward, so once the
    # head block's time has reached it no later block can carry the transfer; our own clock
    # alone is not proof (the chain may lag it, e.g. a stalled or unmined node).
    if auth.valid_before > now or auth.valid_before > head.timestamp:
        return _outcome(case, PENDING, "not_on_chain_yet", evidence)
    return _outcome(case, FAILED, "authorization_expired_unused", evidence)


def _by_used_nonce(case: _Case, evidence: dict[str, Any]) -> SettlementOutcome:
    """The nonce is spent: find the transaction that spent it and judge that one."""
    auth = case.authorization
    # Nodes refuse a range that ends before it starts; such a range simply holds no log.
    logs = (
        case.reader.authorization_used_logs(
            auth.payer, auth.nonce, from_block=case.logs_from_block, to_block=case.head.number
        )
        if case.logs_from_block <= case.head.number
        else []
    )
    users = [log["transactionHash"] for log in logs]
    receipts = [case.reader.receipt(user) for user in users]
    for receipt in receipts:
        if receipt is not None and _settles(receipt, auth, case.network):
            return _by_depth(case, receipt, {**evidence, "settled_by": receipt["transactionHash"]})
    evidence = {**evidence, "used_by": users}
    if not users or any(receipt is None for receipt in receipts):
        # Spent, but by nothing we can read (canceled, pruned logs, lagging node): no guess.
        return _outcome(case, PENDING, "authorization_used_untraced", evidence)
    return _outcome(case, FAILED, "authorization_used_elsewhere", evidence)


def _by_depth(case: _Case, receipt: dict[str, Any], evidence: dict[str, Any]) -> SettlementOutcome:
    """CONFIRMED once the block holding the transfer is `network.confirmations` deep."""
    block = int(receipt["blockNumber"])
    depth = case.head.number - block + 1  # <= 0 if the receipt is newer than our pinned head
    evidence = {**evidence, "block_number": block, "confirmations": max(depth, 0)}
    confirmed = depth >= case.network.confirmations
    if confirmed and is_final_at_depth(case.network, depth):
        # Deep enough for the finality policy already (a seller that confirms at its finality
        # depth): final now, not at the watch's next look. The head's time is the block's
        # when the transfer is in the head block.
        evidence["final"] = True
        if block == case.head.number:
            evidence["block_timestamp"] = case.head.timestamp
    return SettlementOutcome(
        CONFIRMED if confirmed else PENDING,
        tx_hash=receipt["transactionHash"],
        reason_code="" if confirmed else "awaiting_confirmations",
        block_number=block,
        evidence=evidence,
    )


def _outcome(
    case: _Case, status: SettlementStatus, reason: str, evidence: dict[str, Any]
) -> SettlementOutcome:
    return SettlementOutcome(status, tx_hash=case.tx_hash, reason_code=reason, evidence=evidence)


def _settles(receipt: dict[str, Any], authorization: Authorization, network: NetworkConfig) -> bool:
    """True if a successful receipt used this (payer, nonce) and moved exactly this transfer.

    The token emits AuthorizationUsed and then the Transfer it authorizes; pairing each
    AuthorizationUsed with the token's next Transfer keeps a batch of several apart.
    """
    if receipt["status"] != 1:
        return False
    token = network.token_address.lower()
    logs = [log for log in receipt["logs"] if log["address"].lower() == token]
    payer, to = address_topic(authorization.payer), address_topic(authorization.to)
    used = [AUTHORIZATION_USED_TOPIC, payer, authorization.nonce.lower()]
    for i, log in enumerate(logs):
        if _topics(log) != used:
            continue
        transfer = next((n for n in logs[i + 1 :] if _topics(n)[:1] == [TRANSFER_TOPIC]), None)
        if transfer is not None and _topics(transfer) == [TRANSFER_TOPIC, payer, to]:
            return int(transfer["data"], 16) == authorization.value
    return False


def _topics(log: dict[str, Any]) -> list[str]:
    return [str(topic).lower() for topic in log["topics"]]
