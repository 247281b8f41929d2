"""The refund request a paying wallet signs (EIP-712), for x402 buyers without an API key.

x402's refund extension is a proposal (a signed request with an idempotency key; executed,
pending or denied; a signed refund receipt), not a merged spec, so the message is ours and
documented in docs/api.md ("Refund requests"): domain `{name: "Tollbooth refund request",
version: "1", chainId}`, with the chain id of the network the purchase was paid on (the
wallet signs on the chain it paid on, as wallets require), and the struct

    RefundRequest(string purchase, uint256 amount, string reason, string idempotencyKey,
                  uint256 expiry)

`amount` in the asset's atomic units (as x402's `amount`), `expiry` in Unix seconds (as
EIP-3009's `validBefore`). The purchase ref names the seller's record, so a signature cannot
be replayed against another purchase; the idempotency key makes a replay of the same
signed request the same request. Pure functions of values: no database.
"""

from __future__ import annotations

import binascii
import re
from dataclasses import dataclass
from typing import Any

from eth_account import Account
from eth_keys.exceptions import BadSignature
from eth_utils.exceptions import ValidationError

from core import eip712

DOMAIN_NAME = "Tollbooth refund request"
DOMAIN_VERSION = "1"
PRIMARY_TYPE = "RefundRequest"
# Normative for signers: changing a field or its order needs a new domain version.
MESSAGE_FIELDS: list[dict[str, str]] = [
    {"name": "purchase", "type": "string"},
    {"name": "amount", "type": "uint256"},
    {"name": "reason", "type": "string"},
    {"name": "idempotencyKey", "type": "string"},
    {"name": "expiry", "type": "uint256"},
]
DOMAIN_FIELDS: list[dict[str, str]] = [
    {"name": "name", "type": "string"},
    {"name": "version", "type": "string"},
    {"name": "chainId", "type": "uint256"},
]
TYPES: dict[str, list[dict[str, str]]] = {
    "EIP712Domain": DOMAIN_FIELDS,
    PRIMARY_TYPE: MESSAGE_FIELDS,
}
_DOMAIN = eip712.fields_of(DOMAIN_FIELDS)
_MESSAGE = eip712.fields_of(MESSAGE_FIELDS)
_SIGNATURE = re.compile(r"0x[0-9a-fA-F]{130}")
_EIP155 = re.compile(r"eip155:([0-9]{1,19})")
# A reason is for a person to read, not a document.
MAX_REASON = 1000


class SignedRequestInvalid(ValueError):
    """The signed request cannot be read: `reason` says what (malformed, network)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class SignedRefundRequest:
    purchase: str
    amount: int
    reason: str
    idempotency_key: str
    expiry: int
    signature: str

    def message(self) -> dict[str, Any]:
        return {
            "purchase": self.purchase,
            "amount": self.amount,
            "reason": self.reason,
            "idempotencyKey": self.idempotency_key,
            "expiry": self.expiry,
        }


def chain_id_of(network: str) -> int:
    """The EIP-155 chain id of a CAIP-2 network. Raises SignedRequestInvalid."""
    match = _EIP155.fullmatch(network)
    if match is None:
        raise SignedRequestInvalid("network", f"{network} is not an EVM (eip155) network")
    return int(match.group(1))


def domain_for(network: str) -> dict[str, Any]:
    return {"name": DOMAIN_NAME, "version": DOMAIN_VERSION, "chainId": chain_id_of(network)}


def typed_data(*, network: str, message: dict[str, Any]) -> dict[str, Any]:
    """The full typed data a wallet signs (eth_signTypedData_v4's argument)."""
    return {
        "types": TYPES,
        "primaryType": PRIMARY_TYPE,
        "domain": domain_for(network),
        "message": message,
    }


def _uint(value: Any, name: str) -> int:
    # Decimal strings (as x402 writes amounts) or JSON integers; never floats or booleans.
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise SignedRequestInvalid("malformed", f"{name} must be an integer or decimal string")
    text = str(value)
    if not text.isdigit() or len(text) > 78:
        raise SignedRequestInvalid("malformed", f"{name} must be a non-negative integer")
    return int(text)


def signed_request_parse(body: Any) -> SignedRefundRequest:
    """`{"payload": {purchase, amount, reason, idempotencyKey, expiry}, "signature"}` as
    sent. Raises SignedRequestInvalid (malformed)."""
    if not isinstance(body, dict) or not isinstance(body.get("payload"), dict):
        raise SignedRequestInvalid("malformed", "send {payload: {...}, signature: 0x...}")
    payload, signature = body["payload"], body.get("signature")
    if set(payload) != {f["name"] for f in MESSAGE_FIELDS}:
        raise SignedRequestInvalid(
            "malformed", "payload needs exactly: purchase, amount, reason, idempotencyKey, expiry"
        )
    for name in ("purchase", "reason", "idempotencyKey"):
        if not isinstance(payload[name], str):
            raise SignedRequestInvalid("malformed", f"{name} must be a string")
    if len(payload["reason"]) > MAX_REASON:
        raise SignedRequestInvalid("malformed", f"reason is longer than {MAX_REASON} characters")
    if not isinstance(signature, str) or not _SIGNATURE.fullmatch(signature):
        raise SignedRequestInvalid("malformed", "signature must be 0x and 65 bytes of hex")
    return SignedRefundRequest(
        purchase=payload["purchase"],
        amount=_uint(payload["amount"], "amount"),
        reason=payload["reason"],
        idempotency_key=payload["idempotencyKey"],
        expiry=_uint(payload["expiry"], "expiry"),
        signature=signature,
    )


def signed_request_signer(*, request: SignedRefundRequest, network: str) -> str | None:
    """The address that signed `request` on `network`'s chain (checksummed), or None when the
    signature recovers to nothing. Raises SignedRequestInvalid (network)."""
    domain = domain_for(network)
    try:
        signable = eip712.signable(_DOMAIN, domain, PRIMARY_TYPE, _MESSAGE, request.message())
        return str(Account.recover_message(signable, signature=request.signature))
    except (ValueError, TypeError, binascii.Error, ValidationError, BadSignature):
        return None


def signed_request_sign(
    *, message: dict[str, Any], network: str, private_key: str
) -> dict[str, Any]:
    """The body a wallet sends (for tests, the demo and docs/api.md's example)."""
    signable = eip712.signable(_DOMAIN, domain_for(network), PRIMARY_TYPE, _MESSAGE, message)
    signed = Account.sign_message(signable, private_key=private_key)
    payload = {**message, "amount": str(message["amount"])}
    return {"payload": payload, "signature": "0x" + bytes(signed.signature).hex()}
