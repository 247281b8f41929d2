"""EIP-712 hashing for flat structs of fixed shape, with the domain hashed once per domain.

eth-account's `encode_typed_data` re-parses the types and re-hashes the domain on every call
(about a millisecond of CPU each on the paid request, which signs a receipt and recovers
an authorization). For a struct whose fields are all atomic (uint256, address, bytes32,
string) the standard's hashStruct is short enough to write down: typeHash, then each field
encoded to 32 bytes (strings as their keccak). tests/test_eip712.py checks the result
against `encode_typed_data` on the same messages; the signature is still made and
recovered by eth-account.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from eth_account.messages import SignableMessage
from eth_utils import keccak

Fields = tuple[tuple[str, str], ...]  # (name, type), in the struct's order

_UINT256_LIMIT = 1 << 256


def fields_of(spec: Sequence[Mapping[str, str]]) -> Fields:
    """The `[{"name", "type"}]` list eth-account takes, as a hashable tuple."""
    return tuple((f["name"], f["type"]) for f in spec)


@functools.lru_cache(maxsize=64)
def type_hash(primary: str, fields: Fields) -> bytes:
    return keccak(text=f"{primary}({','.join(f'{t} {n}' for n, t in fields)})")


def _encode(kind: str, value: Any, name: str) -> bytes:
    if kind == "uint256":
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an integer, got {value!r}")
        if not 0 <= value < _UINT256_LIMIT:
            raise ValueError(f"{name} is out of the uint256 range")
        return value.to_bytes(32, "big")
    if kind == "string":
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a string, got {value!r}")
        return keccak(text=value)
    if kind == "address":
        raw = bytes.fromhex(value[2:]) if isinstance(value, str) and value[:2] == "0x" else b""
        if len(raw) != 20:
            raise ValueError(f"{name} must be an address (0x + 40 hex characters)")
        return raw.rjust(32, b"\0")
    if kind == "bytes32":
        if not isinstance(value, bytes) or len(value) != 32:
            raise ValueError(f"{name} must be 32 bytes")
        return value
    raise NotImplementedError(f"EIP-712 type {kind} is not supported here")


def struct_hash(primary: str, fields: Fields, message: Mapping[str, Any]) -> bytes:
    """hashStruct(message): ValueError/TypeError for a value its type cannot hold."""
    return keccak(
        type_hash(primary, fields) + b"".join(_encode(t, message[n], n) for n, t in fields)
    )


@functools.lru_cache(maxsize=64)
def domain_separator(fields: Fields, values: tuple[Any, ...]) -> bytes:
    """hashStruct(EIP712Domain): once per domain (keyed by its values, never stale)."""
    domain = dict(zip((n for n, _ in fields), values, strict=True))
    return struct_hash("EIP712Domain", fields, domain)


def signable(
    domain_fields: Fields,
    domain: Mapping[str, Any],
    primary: str,
    fields: Fields,
    message: Mapping[str, Any],
) -> SignableMessage:
    """What `encode_typed_data` returns for the same domain, type and message."""
    header = domain_separator(domain_fields, tuple(domain[n] for n, _ in domain_fields))
    return SignableMessage(b"\x01", header, struct_hash(primary, fields, message))


# The domain of the documents we sign off chain (receipts, evidence packs): chain-agnostic,
# EIP-712 is only the signing format, so chainId is always 1.
DOCUMENT_DOMAIN_TYPE: list[dict[str, str]] = [
    {"name": "name", "type": "string"},
    {"name": "version", "type": "string"},
    {"name": "chainId", "type": "uint256"},
]
_DOCUMENT_DOMAIN_FIELDS = fields_of(DOCUMENT_DOMAIN_TYPE)


@dataclass(frozen=True)
class SignedDocument:
    """One kind of document signed off chain: its own domain name (so one kind's signature
    never passes for another's) and its flat struct. `types` and `domain` are what a
    verifier hands to `encode_typed_data`, as published."""

    name: str
    primary: str
    struct: list[dict[str, str]]
    version: str = "1"
    _fields: Fields = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_fields", fields_of(self.struct))

    @property
    def domain(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "chainId": 1}

    @property
    def types(self) -> dict[str, list[dict[str, str]]]:
        return {"EIP712Domain": DOCUMENT_DOMAIN_TYPE, self.primary: self.struct}

    def signable(self, message: Mapping[str, Any]) -> SignableMessage:
        return signable(_DOCUMENT_DOMAIN_FIELDS, self.domain, self.primary, self._fields, message)
