"""Did a transaction pay a refund back? The chain's word on one payback, check by check.

A chain refund is closed only by a transfer that is mined past the network's finality
policy, not reverted, of the refund's asset (the network's token), from one of the seller's
wallets, to the refund's destination, for exactly the amount owed, in a Transfer log that
closes no other refund. Each check that fails has its own stable code (`PaybackCode`), shown
to finance as it is. Not mined yet, not final yet or a node that cannot be asked is pending
(`PaybackVerdict.pending`): looked at again, never called failed.

Read-only: no database, no locks (payments.paybacks records what this finds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from web3 import Web3

from payments.rails.x402.chain import TRANSFER_TOPIC, ChainReader, ChainUnavailable, is_hash32
from payments.rails.x402.finality import block_finality
from payments.rails.x402.types import NetworkConfig


class PaybackCode(StrEnum):
    """Stable codes: finance and the docs (docs/finance.md) read them. Never rename one."""

    CLOSES = "payback_closes"
    # Pending: nothing is wrong yet, the chain has not said enough.
    AWAITING_FINALITY = "payback_awaiting_finality"
    NOT_MINED = "payback_not_mined"
    CHAIN_UNAVAILABLE = "payback_chain_unavailable"
    # Refused: this transaction does not pay this refund back.
    MALFORMED = "payback_reference_malformed"
    NETWORK_UNKNOWN = "payback_network_unknown"
    NOT_FOUND = "payback_not_found"
    REVERTED = "payback_reverted"
    NO_TRANSFER = "payback_no_transfer"
    WRONG_TOKEN = "payback_wrong_token"  # noqa: S105 (a code, not a secret)
    WRONG_DESTINATION = "payback_wrong_destination"
    NOT_FROM_SELLER = "payback_not_from_seller"
    WRONG_AMOUNT = "payback_wrong_amount"
    ALREADY_USED = "payback_already_used"
    # A payout of the refund (from the refund wallet) is live: it alone may close it.
    PAYOUT_LIVE = "payback_payout_live"


PENDING_CODES = frozenset(
    {PaybackCode.AWAITING_FINALITY, PaybackCode.NOT_MINED, PaybackCode.CHAIN_UNAVAILABLE}
)

MESSAGES = {
    PaybackCode.CLOSES: "The transfer pays this refund back and is final.",
    PaybackCode.AWAITING_FINALITY: "Pending: the transfer matches but is not final yet.",
    PaybackCode.NOT_MINED: "Pending: the node holds the transaction but has not mined it.",
    PaybackCode.CHAIN_UNAVAILABLE: "Pending: the node could not be asked.",
    PaybackCode.MALFORMED: "A chain refund is closed by its payback's transaction hash "
    "(0x + 64 hex).",
    PaybackCode.NETWORK_UNKNOWN: "The refund's network is not configured here.",
    PaybackCode.NOT_FOUND: "The node knows no such transaction.",
    PaybackCode.REVERTED: "The transaction reverted: it moved no money.",
    PaybackCode.NO_TRANSFER: "The transaction holds no token transfer.",
    PaybackCode.WRONG_TOKEN: "The transfer to the destination is of another token.",
    PaybackCode.WRONG_DESTINATION: "No transfer in it goes to the refund's destination.",
    PaybackCode.NOT_FROM_SELLER: "The transfer to the destination is not from a seller wallet.",
    PaybackCode.WRONG_AMOUNT: "The transfer to the destination is not of the amount owed.",
    PaybackCode.ALREADY_USED: "That transfer already closes another refund.",
    PaybackCode.PAYOUT_LIVE: "A payout of this refund is live and pays it itself: wait for it, "
    "or cancel it while it awaits its second approver.",
}


@dataclass(frozen=True)
class Transfer:
    """One ERC-20 Transfer log, decoded."""

    token: str
    sender: str
    recipient: str
    value: int
    tx_hash: str
    log_index: int
    block_number: int


@dataclass(frozen=True)
class PaybackVerdict:
    code: PaybackCode
    tx_hash: str
    # The Transfer log that pays the refund (for CLOSES and AWAITING_FINALITY).
    log_index: int | None = None
    block_number: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def pending(self) -> bool:
        return self.code in PENDING_CODES

    @property
    def closes(self) -> bool:
        return self.code == PaybackCode.CLOSES

    @property
    def message(self) -> str:
        return MESSAGES[self.code]


@dataclass(frozen=True)
class PaybackOwed:
    """What a payback must be: the refund, as the chain must show it."""

    network: NetworkConfig
    destination: str
    amount: int
    # Lower-case addresses: the offerings' recipients, relayers, refund wallets, settings.
    seller_wallets: frozenset[str]
    # (tx hash, log index) of Transfer logs already closing (or claimed by) other refunds.
    used_logs: frozenset[tuple[str, int]] = frozenset()


def transfer_of(log: dict[str, Any]) -> Transfer | None:
    """The Transfer a log records, or None for any other event."""
    topics = log["topics"]
    if len(topics) != 3 or topics[0].lower() != TRANSFER_TOPIC.lower():
        return None
    return Transfer(
        token=log["address"].lower(),
        sender="0x" + topics[1][-40:].lower(),
        recipient="0x" + topics[2][-40:].lower(),
        value=int(log["data"], 16) if log["data"] not in ("0x", "") else 0,
        tx_hash=log["transactionHash"].lower(),
        log_index=int(log["logIndex"]),
        block_number=int(log["blockNumber"]),
    )


def payback_judge(*, tx_hash: str, owed: PaybackOwed, reader: ChainReader) -> PaybackVerdict:
    """The verdict on `tx_hash` as the payback of `owed`. Never raises for the chain: a node
    that cannot be asked is CHAIN_UNAVAILABLE (pending)."""
    if not is_hash32(tx_hash):
        return PaybackVerdict(PaybackCode.MALFORMED, tx_hash)
    tx_hash = tx_hash.lower()
    try:
        receipt = reader.receipt(tx_hash)
        if receipt is None:
            known = reader.transaction_known(tx_hash)
            return PaybackVerdict(
                PaybackCode.NOT_MINED if known else PaybackCode.NOT_FOUND, tx_hash
            )
        if receipt["status"] != 1:
            block = int(receipt["blockNumber"])
            return PaybackVerdict(PaybackCode.REVERTED, tx_hash, block_number=block)
        code, transfer = _match(receipt["logs"], owed)
        if transfer is None:
            return PaybackVerdict(code, tx_hash, evidence={"transfers": _transfers(receipt)})
        is_final, evidence = block_finality(
            network=owed.network,
            reader=reader,
            head=reader.block_number(),
            block=transfer.block_number,
        )
    except ChainUnavailable as exc:
        return PaybackVerdict(PaybackCode.CHAIN_UNAVAILABLE, tx_hash, evidence={"error": str(exc)})
    code = PaybackCode.CLOSES if is_final else PaybackCode.AWAITING_FINALITY
    evidence.update(sender=transfer.sender, value=str(transfer.value))
    # Who sent the transaction paid its gas (the books count it when that is a seller
    # wallet): for a Safe batch, the owner who executed it, not the Safe.
    evidence.update(
        tx_from=str(receipt.get("from") or "").lower(),
        gas_used=int(receipt.get("gasUsed") or 0),
        effective_gas_price=int(receipt.get("effectiveGasPrice") or 0),
    )
    return PaybackVerdict(code, tx_hash, transfer.log_index, transfer.block_number, evidence)


def _match(logs: list[dict[str, Any]], owed: PaybackOwed) -> tuple[PaybackCode, Transfer | None]:
    """The first Transfer log that pays `owed`, or the code of the check that failed nearest
    to a match (so finance reads the real reason, not the first log's)."""
    transfers = [t for log in logs if (t := transfer_of(log)) is not None]
    if not transfers:
        return PaybackCode.NO_TRANSFER, None
    destination, token = owed.destination.lower(), owed.network.token_address.lower()
    to_destination = [t for t in transfers if t.recipient == destination]
    if not to_destination:
        return PaybackCode.WRONG_DESTINATION, None
    candidates = [t for t in to_destination if t.token == token]
    if not candidates:
        return PaybackCode.WRONG_TOKEN, None
    candidates = [t for t in candidates if t.sender in owed.seller_wallets]
    if not candidates:
        return PaybackCode.NOT_FROM_SELLER, None
    candidates = [t for t in candidates if t.value == owed.amount]
    if not candidates:
        return PaybackCode.WRONG_AMOUNT, None
    free = [t for t in candidates if (t.tx_hash, t.log_index) not in owed.used_logs]
    if not free:
        return PaybackCode.ALREADY_USED, None
    return PaybackCode.CLOSES, free[0]


def _transfers(receipt: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"token": t.token, "from": t.sender, "to": t.recipient, "value": str(t.value)}
        for log in receipt["logs"]
        if (t := transfer_of(log)) is not None
    ]


def payback_candidates(
    *, owed: PaybackOwed, reader: ChainReader, from_block: int = 0
) -> list[Transfer]:
    """Transfers on chain that would pay `owed` back (token, seller wallet, destination,
    amount, not used), oldest first. Finality is judged when finance confirms one.
    Raises ChainUnavailable."""
    logs = reader.transfer_logs_to(owed.destination, from_block=from_block)
    found = []
    for log in logs:
        transfer = transfer_of(log)
        if transfer is None or (transfer.tx_hash, transfer.log_index) in owed.used_logs:
            continue
        if transfer.sender in owed.seller_wallets and transfer.value == owed.amount:
            found.append(transfer)
    return found


def lower_address(address: str) -> str:
    return Web3.to_checksum_address(address).lower()
