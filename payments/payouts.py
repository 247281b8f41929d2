"""The chain side of a payout: sign the refund wallet's ERC-20 transfer, send those exact
bytes, and say where the transaction stands, with no database write and no lock held.

A payout is signed once, with a nonce of the refund wallet handed out under the wallet
row's lock (`payout_nonce_allocate`), and its bytes and hash are recorded before anything is
sent (purchases.services.remedy.payouts). From then on only those bytes are ever sent: a dropped
broadcast is re-sent byte for byte, so the nonce makes a second transfer impossible.
Failure is told only on proof (`Look.REVERTED` or `Look.NONCE_TAKEN`, past finality);
everything else is pending, with what it waits for (`Awaiting`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from eth_abi import encode as abi_encode
from hexbytes import HexBytes
from web3 import Web3
from web3.exceptions import Web3RPCError

from core.locks import lock_rows
from payments.models import PayoutWallet
from payments.rails.x402.chain import ChainReader, ChainUnavailable, w3_for
from payments.rails.x402.finality import block_finality
from payments.rails.x402.relayer import ALREADY_SENT, relayer_fee_fields
from payments.rails.x402.types import NetworkConfig
from payments.signers import SignedTransaction, TransactionSigner

TRANSFER_SELECTOR = Web3.keccak(text="transfer(address,uint256)")[:4]
# A USDC transfer uses 35-65k gas; fixed, so signing needs no estimate (an estimate is a
# network call, and the signing runs under the wallet's lock).
PAYOUT_GAS = 100_000
# The send waits this long for the node; a slower answer is "unknown": looked at again.
SEND_TIMEOUT_SECONDS = 10.0


class Awaiting(StrEnum):
    """What a pending payout waits for. Stable: the admin and docs/finance.md show them."""

    SECOND_APPROVAL = "second_approval"  # another staff user must approve its destination
    BROADCAST = "broadcast"  # signed and recorded; its send is due (or was refused: resent)
    INCLUSION = "inclusion"  # the node holds it; not mined yet
    FINALITY = "finality"  # mined; not final under the network's policy yet
    NODE = "node"  # the node could not be asked
    ATTENTION = "attention"  # mined, but the payback check refuses it: a person must look


@dataclass(frozen=True)
class ChainPrep:
    """Read before the signing transaction opens: no network I/O under the wallet lock."""

    pending_nonce: int
    fees: dict[str, int]


def payout_chain_prepare(*, network: NetworkConfig, address: str) -> ChainPrep:
    """The wallet's pending nonce and the fee fields. Raises ChainUnavailable."""
    reader = ChainReader(network)
    pending = reader.pending_nonce(address)
    try:
        fees = relayer_fee_fields(w3_for(network))
    except (OSError, ValueError, Web3RPCError) as exc:
        raise ChainUnavailable(str(exc)) from exc
    return ChainPrep(pending, fees)


def payout_nonce_allocate(*, network: str, address: str, floor: int) -> int:
    """The refund wallet's next nonce on `network`, inside the caller's transaction, under
    the wallet row's lock; `floor` is the chain's pending count (the chain wins if ahead)."""
    address = Web3.to_checksum_address(address)
    PayoutWallet.objects.get_or_create(network=network, address=address)
    wallet = lock_rows(PayoutWallet.objects.filter(network=network, address=address))[0]
    nonce = max(wallet.next_nonce, floor)
    wallet.next_nonce = nonce + 1
    wallet.save(update_fields=["next_nonce", "updated_at"])
    return nonce


def payout_transfer_sign(
    *,
    signer: TransactionSigner,
    network: NetworkConfig,
    destination: str,
    amount: int,
    nonce: int,
    fees: dict[str, int],
) -> SignedTransaction:
    """The token's `transfer(destination, amount)` from the refund wallet, signed (not sent)."""
    data = TRANSFER_SELECTOR + abi_encode(
        ["address", "uint256"], [Web3.to_checksum_address(destination), amount]
    )
    tx: dict[str, Any] = {
        "to": Web3.to_checksum_address(network.token_address),
        "value": 0,
        "data": HexBytes(data).to_0x_hex(),
        "gas": PAYOUT_GAS,
        "nonce": nonce,
        "chainId": network.chain_id,
        **fees,
    }
    signed = signer.sign_transaction(tx)
    return SignedTransaction(signed.raw, signed.tx_hash.lower())


class Sent(StrEnum):
    SENT = "sent"
    KNOWN = "known"  # the node had it already (or its nonce is used: the look tells which)
    REJECTED = "rejected"  # the node refused it (e.g. the wallet cannot pay the gas)
    UNAVAILABLE = "unavailable"  # no answer: it may or may not have arrived


def payout_send(*, network: NetworkConfig, raw: str) -> tuple[Sent, str]:
    """Send the recorded bytes; never raises for the node. Returns the outcome and what the
    node said."""
    w3 = w3_for(network, timeout=SEND_TIMEOUT_SECONDS)
    try:
        w3.eth.send_raw_transaction(HexBytes(raw))
    except Web3RPCError as exc:
        message = str(exc)
        known = any(m in message.lower() for m in ALREADY_SENT)
        return (Sent.KNOWN if known else Sent.REJECTED), message[:500]
    except (OSError, ValueError) as exc:
        return Sent.UNAVAILABLE, str(exc)[:500]
    return Sent.SENT, ""


class Look(StrEnum):
    MINED = "mined"  # a receipt with status 1
    REVERTED = "reverted"  # a receipt with status 0: no money moved
    IN_POOL = "in_pool"
    DROPPED = "dropped"  # unknown to the node, its nonce still free: send it again
    NONCE_TAKEN = "nonce_taken"  # another transaction holds its nonce: it can never land
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class PayoutLook:
    look: Look
    final: bool = False
    block_number: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)


def payout_look(
    *, network: NetworkConfig, tx_hash: str, from_address: str, nonce: int
) -> PayoutLook:
    """Where the payout's transaction stands. Never raises for the chain."""
    reader = ChainReader(network)
    try:
        head = reader.block_number()
        receipt = reader.receipt(tx_hash)
        if receipt is not None:
            block = int(receipt["blockNumber"])
            final, evidence = block_finality(network=network, reader=reader, head=head, block=block)
            look = Look.MINED if receipt["status"] == 1 else Look.REVERTED
            return PayoutLook(look, final, block, evidence)
        if reader.transaction_known(tx_hash):
            return PayoutLook(Look.IN_POOL, evidence={"head": head})
        if reader.latest_nonce(from_address) <= nonce:
            return PayoutLook(Look.DROPPED, evidence={"head": head})
        return _nonce_taken(network, reader, head, from_address, nonce)
    except ChainUnavailable as exc:
        return PayoutLook(Look.UNAVAILABLE, evidence={"error": str(exc)[:500]})


def _nonce_taken(
    network: NetworkConfig, reader: ChainReader, head: int, from_address: str, nonce: int
) -> PayoutLook:
    """Our nonce is used by a transaction that is not ours: final once the block that used
    it is (the count at the last final block already passes it)."""
    final_block = reader.finalized_block_number() if network.finality == "finalized" else None
    if final_block is None:
        final_block = max(head - network.finality_depth + 1, 0)
    who = Web3.to_checksum_address(from_address)
    try:
        count = int(w3_for(network).eth.get_transaction_count(who, final_block))
    except (OSError, ValueError, Web3RPCError) as exc:
        raise ChainUnavailable(str(exc)) from exc
    evidence = {"head": head, "final_block": final_block, "nonce_count_at_final": count}
    return PayoutLook(Look.NONCE_TAKEN, final=count > nonce, evidence=evidence)
