"""Our own verification of an x402 "exact" EVM payment (EIP-3009 TransferWithAuthorization).

Checks run in a fixed order and the first failure wins, so one payload always yields the
same reason code. Every code here is the buyer's move: the evidence they sent does not
satisfy the requirement, and only a corrected (usually newly signed) authorization helps.

Signature rule: an authorization whose signature does not recover to its own `from` is
`invalid_signature`, whichever address it does recover to (there is no separate
"payer mismatch" code): off chain we can only say the claimed payer did not sign it.
Only plain-key (EOA) signatures are recognised; a smart-contract wallet (ERC-1271) payer is
refused as `invalid_signature` because its signature can only be judged on chain.

Chain reads come last and may raise ChainUnavailable: that is "cannot verify now", not a
verification failure, and the caller must not record it as one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from eth_keys.exceptions import BadSignature
from hexbytes import HexBytes

from payments.chain.token import checksummed, recover_authorization_signer
from payments.rails.x402.chain import ChainReader
from payments.rails.x402.types import Authorization, NetworkConfig, Requirements, VerificationFailed

# Settlement happens in a later block: an authorization that expires sooner than this is
# refused rather than broadcast into an almost certain "authorization is expired" revert.
SETTLEMENT_MARGIN_SECONDS = 30

BUYER = "buyer"

VERIFICATION_REASONS: dict[str, str] = {
    "invalid_payload": "Malformed payment payload (missing field, wrong type or format); "
    "buyer: resend it well-formed.",
    "network_mismatch": "The payment names another network; buyer: pay on the required one.",
    "asset_mismatch": "The payment names another token; buyer: pay in the required asset.",
    "invalid_signature": "The signature does not recover to `from` under the token's domain; "
    "buyer: sign again.",
    "recipient_mismatch": "The authorization pays another address than payTo; buyer: sign again.",
    "amount_mismatch": "The value differs from the exact amount required; buyer: sign again.",
    "authorization_not_yet_valid": "validAfter is still in the future; buyer: sign again or wait.",
    "authorization_expired": "validBefore leaves no time to settle; buyer: sign again with a "
    "longer window.",
    "authorization_used": "The nonce is already used on chain; buyer: sign a new authorization.",
    "insufficient_balance": "The payer's balance is below the value; buyer: fund the wallet.",
}

# Whose move it is after each failure: all of these need the buyer to send new evidence.
VERIFICATION_NEXT_MOVE: dict[str, str] = dict.fromkeys(VERIFICATION_REASONS, BUYER)

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{40}")
_NONCE = re.compile(r"0x[0-9a-fA-F]{64}")
_SIGNATURE = re.compile(r"0x[0-9a-fA-F]{130}")
_UINT256_MAX = 2**256 - 1
_SECP256K1_HALF_N = 0x7FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF5D576E7357A4501DDFE92F46681B20A0
_AUTHORIZATION_FIELDS = ("from", "to", "value", "validAfter", "validBefore", "nonce")


def _invalid(detail: str) -> VerificationFailed:
    return VerificationFailed("invalid_payload", detail)


def _uint256(value: object, field: str) -> int:
    """x402 sends numbers as decimal strings; ints are tolerated. bool and float are not:
    bool is an int subclass and a float has already lost precision."""
    if isinstance(value, str) and 0 < len(value) <= 78 and value.isascii() and value.isdigit():
        number = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        raise _invalid(f"{field} must be a decimal string of a non-negative integer")
    if not 0 <= number <= _UINT256_MAX:
        raise _invalid(f"{field} is out of the uint256 range")
    return number


def _address(value: object, field: str) -> str:
    if not isinstance(value, str) or not _ADDRESS.fullmatch(value):
        raise _invalid(f"{field} must be 0x followed by 40 hex characters")
    # Mixed case claims an EIP-55 checksum; a wrong one is a typo, not an address to pay.
    mixed = value[2:] != value[2:].lower() and value[2:] != value[2:].upper()
    checksum = checksummed(value)
    if mixed and value != checksum:  # Web3.is_checksum_address, without its own keccak
        raise _invalid(f"{field} has an invalid EIP-55 checksum")
    return checksum


def _hex(value: object, pattern: re.Pattern[str], field: str, size: int) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise _invalid(f"{field} must be 0x followed by {size} hex characters")
    return value.lower()


def parse_authorization(payload: object) -> Authorization:
    """The x402 `payload` object ({signature, authorization: {...}}) as an Authorization.

    Unknown extra keys are ignored: they are not signed, so they carry nothing.
    """
    if not isinstance(payload, Mapping):
        raise _invalid("payload must be an object")
    auth = payload.get("authorization")
    if not isinstance(auth, Mapping):
        raise _invalid("payload.authorization must be an object")
    missing = [name for name in _AUTHORIZATION_FIELDS if name not in auth]
    if missing or "signature" not in payload:
        raise _invalid(f"missing fields: {', '.join(missing or ['signature'])}")
    return Authorization(
        payer=_address(auth["from"], "from"),
        to=_address(auth["to"], "to"),
        value=_uint256(auth["value"], "value"),
        valid_after=_uint256(auth["validAfter"], "validAfter"),
        valid_before=_uint256(auth["validBefore"], "validBefore"),
        nonce=_hex(auth["nonce"], _NONCE, "nonce", 64),
        signature=_hex(payload["signature"], _SIGNATURE, "signature", 130),
    )


def _same_address(a: str, b: str) -> bool:
    return a.lower() == b.lower()


def _check_signature(authorization: Authorization, network: NetworkConfig) -> None:
    raw = HexBytes(authorization.signature)
    # The token (like USDC) refuses high-s and v outside 27/28 (0/1 are normalised by the
    # broadcaster); accepting them here would pass a payment that can only revert.
    if len(raw) != 65 or raw[64] not in (0, 1, 27, 28):
        raise VerificationFailed("invalid_signature", "signature v must be 27 or 28")
    if int.from_bytes(raw[32:64], "big") > _SECP256K1_HALF_N:
        raise VerificationFailed("invalid_signature", "signature s is not in the lower half")
    try:
        signer = recover_authorization_signer(
            token_address=network.token_address,
            chain_id=network.chain_id,
            name=network.token_name,
            version=network.token_version,
            authorization=authorization.as_wire()["authorization"],
            signature=authorization.signature,
        )
    except (BadSignature, ValueError, TypeError) as exc:  # BadSignature is no ValueError
        raise VerificationFailed("invalid_signature", "signature cannot be recovered") from exc
    if not _same_address(signer, authorization.payer):
        raise VerificationFailed("invalid_signature", "signature was not made by `from`")


def _check_terms(
    authorization: Authorization, requirements: Requirements, network: NetworkConfig
) -> None:
    if requirements.network != network.caip2:
        raise VerificationFailed("network_mismatch", f"required {requirements.network}")
    if not _same_address(requirements.asset, network.token_address):
        raise VerificationFailed("asset_mismatch", f"required asset {requirements.asset}")
    _check_signature(authorization, network)
    if not _same_address(authorization.to, requirements.pay_to):
        raise VerificationFailed("recipient_mismatch", f"payTo must be {requirements.pay_to}")
    if authorization.value != requirements.amount:
        raise VerificationFailed("amount_mismatch", f"amount must be {requirements.amount}")


def _check_window(authorization: Authorization, now: int) -> None:
    # The token requires validAfter < block.timestamp < validBefore.
    if authorization.valid_after > now:
        raise VerificationFailed("authorization_not_yet_valid", "validAfter is in the future")
    if authorization.valid_before < now + SETTLEMENT_MARGIN_SECONDS:
        raise VerificationFailed(
            "authorization_expired",
            f"validBefore must be at least {SETTLEMENT_MARGIN_SECONDS}s ahead",
        )


def verify_payment_offline(
    *, authorization: Authorization, requirements: Requirements, network: NetworkConfig, now: int
) -> None:
    """The checks that need no RPC: terms, signature, validity window. Raise VerificationFailed."""
    _check_terms(authorization, requirements, network)
    _check_window(authorization, now)


def verify_payment_on_chain(*, authorization: Authorization, reader: ChainReader) -> None:
    """Nonce unused and balance sufficient. Raise VerificationFailed, or ChainUnavailable."""
    if reader.authorization_state(authorization.payer, authorization.nonce):
        raise VerificationFailed("authorization_used", "the nonce is already used on chain")
    if reader.balance_of(authorization.payer) < authorization.value:
        raise VerificationFailed("insufficient_balance", "balance is below the value")


def verify_payment_funds(*, authorization: Authorization, reader: ChainReader) -> int:
    """verify_payment_on_chain in one round trip; returns the chain head read with it.
    Raise VerificationFailed, or ChainUnavailable."""
    used, balance, head = reader.funds_state(authorization.payer, authorization.nonce)
    if used:
        raise VerificationFailed("authorization_used", "the nonce is already used on chain")
    if balance < authorization.value:
        raise VerificationFailed("insufficient_balance", "balance is below the value")
    return head


def verify_payment(
    *,
    authorization: Authorization,
    requirements: Requirements,
    network: NetworkConfig,
    now: int,
    reader: ChainReader,
) -> None:
    """Raise VerificationFailed with the first failing reason; return when all hold.

    ChainUnavailable from the chain reads propagates: "cannot verify now", not a failure.
    """
    # Off-chain checks first: they are free and most failures are caught before any RPC.
    verify_payment_offline(
        authorization=authorization, requirements=requirements, network=network, now=now
    )
    verify_payment_on_chain(authorization=authorization, reader=reader)
