"""Signed receipts: EIP-712 typed data signed with the seller's receipt key.

The shape follows the x402 offer-and-receipt extension (a draft: `specs/extensions/
extension-offer-and-receipt.md` in coinbase/x402, whose wire shape "may change"): an
envelope `{format: "eip712", payload, signature}`, a domain `{name, version: "1",
chainId: 1}` (chain-agnostic: EIP-712 is only the signing format here), and the draft's
receipt fields first (`version`, `network`, `resourceUrl`, `payer`, `issuedAt`,
`transaction`). The draft's EIP-712 schema is normative and has no room for what a buyer
needs to check a purchase offline (amount, asset, purchase, offering, settlement time, the
result's SHA-256), and a changed schema must not reuse its domain: ours is named
"Tollbooth receipt". The envelope's `keyId` is unsigned (like the draft's `acceptIndex`):
the signer is recovered from the signature and must be one of the keys published at
`/.well-known/tollbooth-receipts`.

Pure functions of the payload and the key: verifying needs nothing but the receipt and the
public address (`manage.py receipt_verify`, or the eth-account snippet in docs/receipts.md).
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from eth_account import Account
from eth_account.signers.local import LocalAccount
from eth_keys.datatypes import PrivateKey
from eth_keys.exceptions import BadSignature
from eth_utils.exceptions import ValidationError
from hexbytes import HexBytes

from core import eip712

FORMAT = "eip712"
RECEIPT_VERSION = 1
# Normative for verifiers: changing a field or its order needs a new domain version.
RECEIPT_FIELDS: list[dict[str, str]] = [
    {"name": "version", "type": "uint256"},
    {"name": "network", "type": "string"},
    {"name": "resourceUrl", "type": "string"},
    {"name": "payer", "type": "string"},
    {"name": "issuedAt", "type": "uint256"},
    {"name": "transaction", "type": "string"},
    {"name": "receipt", "type": "string"},
    {"name": "purchase", "type": "string"},
    {"name": "offering", "type": "string"},
    {"name": "amount", "type": "string"},
    {"name": "asset", "type": "string"},
    {"name": "settledAt", "type": "uint256"},
    {"name": "resultSha256", "type": "string"},
]
RECEIPT = eip712.SignedDocument("Tollbooth receipt", "Receipt", RECEIPT_FIELDS)
DOMAIN, TYPES, PRIMARY_TYPE = RECEIPT.domain, RECEIPT.types, RECEIPT.primary
_UINT_FIELDS = frozenset(f["name"] for f in RECEIPT_FIELDS if f["type"] == "uint256")


class ReceiptInvalid(Exception):
    """The receipt does not verify: `reason` says which check failed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class SigningKey:
    key_id: str
    address: str
    private_key: str


@dataclass(frozen=True)
class PublishedKey:
    key_id: str
    address: str
    status: str  # "current" signs new receipts; "retired" still verifies old ones


def key_id_for(address: str) -> str:
    """A key's default id: stable, derived from its address, so rotation needs no registry."""
    return "rk-" + address.lower().removeprefix("0x")[:12]


def signing_key() -> SigningKey:
    """The current receipt key: TOLLBOOTH_RECEIPT_KEY, or (demo and tests only) a key
    generated once into RECEIPT_KEY_FILE, which every process of the run then shares.
    Raises ImproperlyConfigured when neither is set (production)."""
    config = settings.RECEIPTS
    private_key = config["KEY"] or _generated_key(config.get("KEY_FILE"))
    account = _account(private_key)
    return SigningKey(config["KEY_ID"] or key_id_for(account.address), account.address, private_key)


@functools.lru_cache(maxsize=8)
def _account(private_key: str) -> LocalAccount:
    # Deriving the address is an elliptic-curve multiplication: once per key, not per
    # receipt. Keyed by the key itself, so a rotated TOLLBOOTH_RECEIPT_KEY is a new entry.
    account: LocalAccount = Account.from_key(private_key)
    return account


@functools.lru_cache(maxsize=8)
def _private_key(private_key: str) -> PrivateKey:
    return PrivateKey(HexBytes(private_key))  # its public key derived once (keyed by value)


def parsed_private_key(key: SigningKey) -> PrivateKey:
    """The key parsed once, for another document the receipt key signs
    (fulfillment.evidence_seal)."""
    return _private_key(key.private_key)


def _generated_key(key_file: Path | None) -> str:
    if key_file is None:
        raise ImproperlyConfigured("TOLLBOOTH_RECEIPT_KEY is required: the receipts' signing key.")
    path = Path(key_file)
    try:  # O_EXCL: of processes starting at once, one writes the key and the others read it
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        text = path.read_text().strip()
        if text:
            return text
        raise ImproperlyConfigured(f"{path} is empty: delete it to generate a new key") from None
    with os.fdopen(fd, "w") as out:
        key = "0x" + os.urandom(32).hex()
        out.write(key)
    return key


def published_keys() -> list[PublishedKey]:
    """Every key a receipt of ours may carry: the current one and the retired ones
    (TOLLBOOTH_RECEIPT_RETIRED_KEYS, `key_id=0xaddress` or `0xaddress`), never dropped."""
    current = signing_key()
    keys = [PublishedKey(current.key_id, current.address, "current")]
    for entry in settings.RECEIPTS["RETIRED_KEYS"]:
        key_id, _, address = entry.rpartition("=")
        keys.append(PublishedKey(key_id or key_id_for(address), address, "retired"))
    return keys


def _typed(payload: dict[str, Any]) -> Any:
    """What `encode_typed_data` gives for {types: TYPES, domain: DOMAIN, message} (the
    domain hashed once: core/eip712.py)."""
    message = {
        f["name"]: int(payload[f["name"]]) if f["name"] in _UINT_FIELDS else payload[f["name"]]
        for f in RECEIPT_FIELDS
    }
    return RECEIPT.signable(message)


def receipt_sign(*, payload: dict[str, Any], key: SigningKey) -> str:
    """The signed receipt as the JSON text that is stored and sent (compact, keys in a fixed
    order), so every later copy of it is byte for byte the first."""
    # With the parsed key: LocalAccount.sign_message derives its public key again.
    signed = Account.sign_message(_typed(payload), private_key=_private_key(key.private_key))
    document = {
        "format": FORMAT,
        "keyId": key.key_id,
        "payload": {f["name"]: payload[f["name"]] for f in RECEIPT_FIELDS},
        "signature": "0x" + bytes(signed.signature).hex(),
    }
    return json.dumps(document, separators=(",", ":"))


def receipt_header_value(text: str) -> str:
    """The receipt as it rides in the Tollbooth-Receipt header: base64 of its JSON text."""
    return base64.b64encode(text.encode()).decode()


def receipt_decode(value: str | bytes | dict[str, Any]) -> dict[str, Any]:
    """A receipt given as its JSON document, its JSON text or the header's base64.
    Raises ReceiptInvalid: malformed."""
    if isinstance(value, dict):
        return value
    raw = value.encode() if isinstance(value, str) else value
    raw = raw.strip()
    try:
        if not raw.startswith(b"{"):
            raw = base64.b64decode(raw, validate=True)
        document = json.loads(raw)
    except (binascii.Error, ValueError) as exc:
        raise ReceiptInvalid("malformed") from exc
    if not isinstance(document, dict):
        raise ReceiptInvalid("malformed")
    return document


def receipt_signer(document: dict[str, Any]) -> str:
    """The address that signed this receipt (checksummed). Raises ReceiptInvalid:
    unsupported_format, missing_fields, field_types, bad_signature."""
    if document.get("format") != FORMAT:
        raise ReceiptInvalid("unsupported_format")
    payload = document.get("payload")
    if not isinstance(payload, dict) or set(payload) != {f["name"] for f in RECEIPT_FIELDS}:
        raise ReceiptInvalid("missing_fields")
    for f in RECEIPT_FIELDS:
        value = payload[f["name"]]
        is_uint = f["type"] == "uint256"
        if (is_uint and (not isinstance(value, int) or isinstance(value, bool) or value < 0)) or (
            not is_uint and not isinstance(value, str)
        ):
            raise ReceiptInvalid("field_types")
    if payload["version"] != RECEIPT_VERSION:
        raise ReceiptInvalid("unsupported_version")
    try:
        return str(
            Account.recover_message(_typed(payload), signature=str(document.get("signature")))
        )
    except (ValueError, TypeError, binascii.Error, ValidationError, BadSignature) as exc:
        raise ReceiptInvalid("bad_signature") from exc


def receipt_verify(document: dict[str, Any], *, addresses: list[str]) -> str:
    """Verify a receipt against the seller's published addresses; returns the signer.
    Raises ReceiptInvalid: as receipt_signer, or unknown_signer (signed by another key,
    or any field changed since it was signed)."""
    signer = receipt_signer(document)
    if signer.lower() not in {address.lower() for address in addresses}:
        raise ReceiptInvalid("unknown_signer")
    return signer


def receipt_keys_document() -> dict[str, Any]:
    """What /.well-known/tollbooth-receipts publishes: how receipts are signed and every key
    that ever signed one (current and retired), so a receipt verifies offline for ever."""
    return {
        "format": FORMAT,
        "domain": DOMAIN,
        "primaryType": PRIMARY_TYPE,
        "types": TYPES,
        "keys": [
            {"keyId": key.key_id, "address": key.address, "status": key.status}
            for key in published_keys()
        ],
        "spec": "https://github.com/coinbase/x402/blob/main/specs/extensions/"
        "extension-offer-and-receipt.md (draft; docs/receipts.md says where we differ)",
    }
