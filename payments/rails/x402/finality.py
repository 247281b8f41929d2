"""Is a settled x402 payment final yet, still in the chain, or undone by a reorg?

A payment counts as settled at the network's confirmation depth, so its work can run; a
reorg deeper than that can still undo it. Until the network's finality policy says no reorg
can (`NetworkConfig.finality`), the settlement stays watched:

- "depth": final once its block is `finality_depth` deep (anvil and other local chains,
  whose `finalized` tag means nothing);
- "finalized": final once its block is at or below the node's `finalized` block; a node
  that reports none falls back to the depth.

When the transaction's receipt is gone, the authorization itself is looked up by (payer,
nonce) (payments.rails.x402.lookup): it may have landed again (re-mined, or another submission of
the same authorization), or its nonce may be unused again (the money is back with the payer:
the same authorization can settle again while its window is open), or it can no longer land.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from payments.rails.base import SettlementOutcome, SettlementStatus
from payments.rails.x402.chain import ChainReader, ChainUnavailable
from payments.rails.x402.lookup import _settles as settles_transfer  # the lookup's own rule
from payments.rails.x402.lookup import settlement_lookup
from payments.rails.x402.types import Authorization, NetworkConfig


class Finality(StrEnum):
    FINAL = "final"  # no reorg can undo it any more
    WATCHING = "watching"  # in the chain, not final yet
    UNDONE = "undone"  # its transfer is no longer in the chain (`outcome` says what now)
    UNKNOWN = "unknown"  # the chain could not say: look again later


@dataclass(frozen=True)
class FinalityCheck:
    finality: Finality
    tx_hash: str | None
    block_number: int | None
    # For UNDONE: the look-up by (payer, nonce), as reconciliation records it.
    outcome: SettlementOutcome | None = None
    evidence: dict[str, Any] = field(default_factory=dict)


def settlement_finality(
    *,
    authorization: Authorization,
    network: NetworkConfig,
    tx_hash: str | None,
    reader: ChainReader,
    now: int,
    logs_from_block: int = 0,
) -> FinalityCheck:
    """Where the settled transfer of `authorization` (carried by `tx_hash`) stands now."""
    try:
        head = reader.latest_block()
        receipt = reader.receipt(tx_hash) if tx_hash else None
        if receipt is not None and settles_transfer(receipt, authorization, network):
            block = int(receipt["blockNumber"])
            return _judge(network, reader, head.number, receipt["transactionHash"], block)
    except ChainUnavailable as exc:
        return FinalityCheck(Finality.UNKNOWN, tx_hash, None, evidence={"error": str(exc)})
    outcome = settlement_lookup(
        authorization=authorization,
        network=network,
        tx_hash=tx_hash,
        reader=reader,
        now=now,
        logs_from_block=logs_from_block,
    )
    evidence = {"vanished_tx": tx_hash, **outcome.evidence}
    if outcome.status == SettlementStatus.CONFIRMED or (
        outcome.reason_code == "awaiting_confirmations"
    ):
        # In the chain again (re-mined, or another submission of the same authorization):
        # still one transfer, watched from its new block.
        return FinalityCheck(
            Finality.WATCHING, outcome.tx_hash, outcome.block_number, evidence=evidence
        )
    if outcome.reason_code in ("chain_unavailable", "authorization_used_untraced"):
        return FinalityCheck(Finality.UNKNOWN, tx_hash, None, outcome, evidence)
    # Nonce unused again (not_on_chain_yet), or it can never land for us any more.
    return FinalityCheck(Finality.UNDONE, tx_hash, None, outcome, evidence)


def _judge(
    network: NetworkConfig, reader: ChainReader, head: int, tx_hash: str, block: int
) -> FinalityCheck:
    is_final, evidence = block_finality(network=network, reader=reader, head=head, block=block)
    finality = Finality.FINAL if is_final else Finality.WATCHING
    return FinalityCheck(finality, tx_hash.lower(), block, evidence=evidence)


def block_finality(
    *, network: NetworkConfig, reader: ChainReader, head: int, block: int
) -> tuple[bool, dict[str, Any]]:
    """Whether `block` is final under the network's policy, and the evidence for it (policy,
    depth, the finalized block). Raises ChainUnavailable when the node cannot say."""
    depth = head - block + 1
    evidence: dict[str, Any] = {"policy": network.finality, "block_number": block, "depth": depth}
    finalized = reader.finalized_block_number() if network.finality == "finalized" else None
    if finalized is not None:
        evidence["finalized_block"] = finalized
        return block <= finalized, evidence
    evidence["finality_depth"] = network.finality_depth
    return depth >= network.finality_depth, evidence
