"""The evidence pack's seal: the pack's canonical content hashed, the hash signed as EIP-712
typed data with the receipt key (fulfillment.receipt_signing: the same key, key ids,
rotation and publication at `/.well-known/tollbooth-receipts`), so a pack verifies years
later offline with nothing but the file and the seller's published addresses.

The signed struct is small and fixed (`EvidencePack{version, purchase, issuedAt,
contentSha256}`); the content it seals is any JSON, hashed as its canonical form
(core.canonical: keys sorted, no spaces, UTF-8). A new domain name ("Tollbooth evidence
pack"), never the receipts', so a receipt's signature can never pass for a pack's nor the
other way round. The envelope's `keyId` and `signer` are unsigned hints: the signer is
recovered from the signature and must be one of the published addresses.
"""

from __future__ import annotations

import binascii
import json
from typing import Any

from eth_account import Account
from eth_keys.exceptions import BadSignature
from eth_utils.exceptions import ValidationError

from core import eip712
from core.canonical import canonical_json, sha256_hex
from fulfillment.receipt_signing import SigningKey, parsed_private_key

FORMAT = "tollbooth-evidence-pack"
PACK_VERSION = 1
# Normative for verifiers (docs/evidence.md): changing a field needs a new domain version.
SEAL_FIELDS: list[dict[str, str]] = [
    {"name": "version", "type": "uint256"},
    {"name": "purchase", "type": "string"},
    {"name": "issuedAt", "type": "uint256"},
    {"name": "contentSha256", "type": "string"},
]
SEAL = eip712.SignedDocument("Tollbooth evidence pack", "EvidencePack", SEAL_FIELDS)
DOMAIN, TYPES, PRIMARY_TYPE = SEAL.domain, SEAL.types, SEAL.primary


class PackInvalid(Exception):
    """The pack does not verify: `reason` says which check failed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def content_sha256(content: Any) -> str:
    return sha256_hex(canonical_json(content))


def pack_seal(*, content: dict[str, Any], purchase: str, issued_at: int, key: SigningKey) -> str:
    """The signed pack as the canonical JSON text that is handed over."""
    seal = {
        "version": PACK_VERSION,
        "purchase": purchase,
        "issuedAt": issued_at,
        "contentSha256": content_sha256(content),
    }
    signable = SEAL.signable(seal)
    signed = Account.sign_message(signable, private_key=parsed_private_key(key))
    document = {
        "format": FORMAT,
        "keyId": key.key_id,
        "signer": key.address,
        "seal": seal,
        "content": content,
        "signature": "0x" + bytes(signed.signature).hex(),
    }
    return canonical_json(document)


def pack_decode(raw: str | bytes) -> dict[str, Any]:
    """The pack's JSON document. Raises PackInvalid: malformed."""
    try:
        document = json.loads(raw)
    except ValueError as exc:
        raise PackInvalid("malformed") from exc
    if not isinstance(document, dict):
        raise PackInvalid("malformed")
    return document


def _seal_checked(document: dict[str, Any]) -> dict[str, Any]:
    if document.get("format") != FORMAT:
        raise PackInvalid("unsupported_format")
    seal, content = document.get("seal"), document.get("content")
    if (
        not isinstance(seal, dict)
        or set(seal) != {f["name"] for f in SEAL_FIELDS}
        or not isinstance(content, dict)
    ):
        raise PackInvalid("missing_fields")
    if seal["version"] != PACK_VERSION:
        raise PackInvalid("unsupported_version")
    if seal["contentSha256"] != content_sha256(content):
        raise PackInvalid("content_changed")
    if seal["purchase"] != (content.get("purchase") or {}).get("ref"):
        raise PackInvalid("purchase_mismatch")
    return seal


def pack_signer(document: dict[str, Any]) -> str:
    """The address that sealed this pack (checksummed). Raises PackInvalid:
    unsupported_format, missing_fields, unsupported_version, content_changed,
    purchase_mismatch, bad_signature."""
    seal = _seal_checked(document)
    try:
        signable = SEAL.signable(seal)
        return str(Account.recover_message(signable, signature=str(document.get("signature"))))
    except (ValueError, TypeError, binascii.Error, ValidationError, BadSignature) as exc:
        raise PackInvalid("bad_signature") from exc


def pack_verify(document: dict[str, Any], *, addresses: list[str]) -> str:
    """Verify a pack against the seller's published addresses; returns the signer. Raises
    PackInvalid: as pack_signer, or unknown_signer (another key signed it, or a sealed
    field changed since)."""
    signer = pack_signer(document)
    if signer.lower() not in {address.lower() for address in addresses}:
        raise PackInvalid("unknown_signer")
    return signer
