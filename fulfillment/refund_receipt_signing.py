"""Signed refund receipts: the proof a buyer keeps that its refund request was executed,
signed with the receipt key (fulfillment.receipt_signing: the same key, key ids, rotation
and publication at `/.well-known/tollbooth-receipts`), verifiable offline.

The envelope is the purchase receipt's (`{format: "eip712", keyId, payload, signature}`),
under a domain of its own ("Tollbooth refund receipt"), so a purchase receipt's signature can
never pass for a refund's nor the other way round. Every field comes from the paid refund,
`issuedAt` included (its paid time): the same refund always signs to the same bytes, so it
is signed when asked for and never stored.
"""

from __future__ import annotations

import binascii
from typing import Any

from eth_account import Account
from eth_keys.exceptions import BadSignature
from eth_utils.exceptions import ValidationError

from core import eip712
from fulfillment.receipt_signing import (
    FORMAT,
    SigningKey,
    parsed_private_key,
    receipt_keys_document,
)

REFUND_RECEIPT_VERSION = 1
DOMAIN: dict[str, Any] = {"name": "Tollbooth refund receipt", "version": "1", "chainId": 1}
# Normative for verifiers (docs/receipts.md): changing a field needs a new domain version.
FIELDS: list[dict[str, str]] = [
    {"name": "version", "type": "uint256"},
    {"name": "purchase", "type": "string"},
    {"name": "refundRequest", "type": "string"},
    {"name": "network", "type": "string"},
    {"name": "asset", "type": "string"},
    {"name": "amount", "type": "string"},
    {"name": "payer", "type": "string"},
    {"name": "method", "type": "string"},
    {"name": "transaction", "type": "string"},
    {"name": "issuedAt", "type": "uint256"},
]
TYPES: dict[str, list[dict[str, str]]] = {
    "EIP712Domain": [
        {"name": "name", "type": "string"},
        {"name": "version", "type": "string"},
        {"name": "chainId", "type": "uint256"},
    ],
    "RefundReceipt": FIELDS,
}
PRIMARY_TYPE = "RefundReceipt"
_DOMAIN_FIELDS = eip712.fields_of(TYPES["EIP712Domain"])
_FIELDS = eip712.fields_of(FIELDS)


def _signable(payload: dict[str, Any]) -> Any:
    message = {f["name"]: payload[f["name"]] for f in FIELDS}
    return eip712.signable(_DOMAIN_FIELDS, DOMAIN, PRIMARY_TYPE, _FIELDS, message)


def refund_receipt_sign(*, payload: dict[str, Any], key: SigningKey) -> dict[str, Any]:
    """The signed refund receipt document. `payload` has exactly FIELDS (uints as ints)."""
    signed = Account.sign_message(_signable(payload), private_key=parsed_private_key(key))
    return {
        "format": FORMAT,
        "keyId": key.key_id,
        "payload": {f["name"]: payload[f["name"]] for f in FIELDS},
        "signature": "0x" + bytes(signed.signature).hex(),
    }


def refund_receipt_signer(document: dict[str, Any]) -> str | None:
    """The address that signed this refund receipt (checksummed); None when it is not one
    (wrong format, missing or mistyped fields, a signature that recovers to nothing). Its
    caller compares it with the published addresses."""
    payload = document.get("payload")
    if document.get("format") != FORMAT or not isinstance(payload, dict):
        return None
    if set(payload) != {f["name"] for f in FIELDS}:
        return None
    try:
        return str(Account.recover_message(_signable(payload), signature=document["signature"]))
    except (KeyError, ValueError, TypeError, binascii.Error, ValidationError, BadSignature):
        return None


def refund_receipt_keys_entry() -> dict[str, Any]:
    """How refund receipts are signed, for `/.well-known/tollbooth-receipts`."""
    return {"domain": DOMAIN, "primaryType": PRIMARY_TYPE, "types": TYPES}


def published_receipts_document() -> dict[str, Any]:
    """/.well-known/tollbooth-receipts: the receipts' keys and signing, and the refund
    receipts' signing (the same keys, under their own domain: docs/receipts.md)."""
    return {**receipt_keys_document(), "refundReceipt": refund_receipt_keys_entry()}
