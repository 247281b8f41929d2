"""Permit2 state for `upto` payments: has a buyer's signed nonce been used?

An `upto` payment is a Permit2 `PermitWitnessTransferFrom` signature (issue 34, part 2).
Permit2 has no `authorizationState` and no event naming the nonce: its signature transfers
spend "unordered" nonces kept as bits, 256 to a word, in `nonceBitmap(owner, word)`. A nonce
is used once its bit is set, by a settlement or by the owner's `invalidateUnorderedNonces`
(a cancel). Recovery reads it before every (re)broadcast, as it reads `authorizationState`
for EIP-3009.
"""

from __future__ import annotations

from dataclasses import dataclass

from eth_abi import decode as abi_decode
from eth_abi import encode as abi_encode
from eth_abi.exceptions import DecodingError
from hexbytes import HexBytes
from web3 import Web3
from web3.types import BlockIdentifier
from x402.mechanisms.evm.constants import PERMIT2_ADDRESS, X402_UPTO_PERMIT2_PROXY_ADDRESS

from payments.rails.x402.chain import _rpc

PERMIT2 = Web3.to_checksum_address(PERMIT2_ADDRESS)
UPTO_PROXY = Web3.to_checksum_address(X402_UPTO_PERMIT2_PROXY_ADDRESS)
NONCE_BITMAP_SELECTOR = Web3.keccak(text="nonceBitmap(address,uint256)")[:4]
_UINT256_MAX = 2**256 - 1


def permit2_nonce(value: int | str) -> int:
    """A Permit2 nonce as an int: the SDKs carry it as a decimal string (a uint256, not the
    0x-hex bytes32 of EIP-3009). Raises ValueError for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"a Permit2 nonce is a uint256, not {value!r}")
    if isinstance(value, str) and not value.isdigit():
        raise ValueError(f"a Permit2 nonce is a decimal string, not {value!r}")
    nonce = int(value)
    if not 0 <= nonce <= _UINT256_MAX:
        raise ValueError(f"a Permit2 nonce is a uint256, not {value!r}")
    return nonce


def nonce_bitmap_position(nonce: int | str) -> tuple[int, int]:
    """(word, bit): the nonce's word in `nonceBitmap(owner, word)` and its bit in that word."""
    value = permit2_nonce(nonce)
    return value >> 8, value & 0xFF


def permit2_nonce_used(
    w3: Web3, owner: str, nonce: int | str, *, block: BlockIdentifier = "latest"
) -> bool:
    """True once Permit2 has spent `owner`'s `nonce` (settled or cancelled), as of `block`.

    Raises ChainUnavailable when the node cannot be asked: unknown, never "unused", so a
    caller about to rebroadcast waits rather than sends. ValueError for a malformed owner or
    nonce (before any call, so no caller mistake is taken for an outage)."""
    word, bit = nonce_bitmap_position(nonce)
    who = Web3.to_checksum_address(owner)
    data = NONCE_BITMAP_SELECTOR + abi_encode(["address", "uint256"], [who, word])
    with _rpc():
        answer = w3.eth.call({"to": PERMIT2, "data": data}, block_identifier=block)
        (bitmap,) = abi_decode(["uint256"], bytes(answer))
    return bool((int(bitmap) >> bit) & 1)


# --- which transaction used it: the proxy's calldata ---------------------------------------

UPTO_SETTLE_SIGNATURE = (
    "settle(((address,uint256),uint256,uint256),uint256,address,(address,address,uint256),bytes)"
)
UPTO_SETTLE_SELECTOR = Web3.keccak(text=UPTO_SETTLE_SIGNATURE)[:4]
_UPTO_SETTLE_TYPES = [
    "((address,uint256),uint256,uint256)", "uint256", "address", "(address,address,uint256)",
    "bytes",
]  # fmt: skip


@dataclass(frozen=True)
class UptoSettleCall:
    """An upto proxy `settle` as a transaction carried it: whose Permit2 nonce it spends, and
    how much of the ceiling it charged to whom."""

    token: str
    ceiling: int
    nonce: int
    deadline: int
    amount: int
    owner: str
    pay_to: str
    facilitator: str
    valid_after: int
    signature: bytes


def decode_upto_settle(calldata: bytes | str) -> UptoSettleCall | None:
    """The settle a transaction's input carries, or None when it is no upto proxy `settle`
    (another call, or garbage). Bytes past the arguments (an ERC-8021 data suffix the SDK may
    append) are ignored, as the contract ignores them. Permit2 logs no nonce: recovery finds
    candidates by their `Transfer(owner -> payTo)` and tells which one spent a nonce by this."""
    data = bytes(HexBytes(calldata))
    if data[:4] != UPTO_SETTLE_SELECTOR:
        return None
    try:
        permit, amount, owner, witness, signature = abi_decode(_UPTO_SETTLE_TYPES, data[4:])
    except (DecodingError, ValueError, OverflowError):
        return None
    (token, ceiling), nonce, deadline = permit
    pay_to, facilitator, valid_after = witness
    return UptoSettleCall(
        token=Web3.to_checksum_address(token),
        ceiling=ceiling,
        nonce=nonce,
        deadline=deadline,
        amount=amount,
        owner=Web3.to_checksum_address(owner),
        pay_to=Web3.to_checksum_address(pay_to),
        facilitator=Web3.to_checksum_address(facilitator),
        valid_after=valid_after,
        signature=bytes(signature),
    )
