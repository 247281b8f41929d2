"""Sign-in-with-x (the x402 extension `sign-in-with-x`): a payer proves its wallet with a
signed CAIP-122 message (EIP-4361, "Sign-In with Ethereum", on EVM chains) instead of paying.

The 402 declares a challenge (`extensions["sign-in-with-x"]`: domain, uri, nonce, issuedAt,
expirationTime, the chains it may be signed for); the client signs the message those fields
make and sends them back with its address and signature, base64 JSON in the
`SIGN-IN-WITH-X` header. The official clients (`x402.extensions.sign_in_with_x`, x402 2.25)
format the message with `signinwithethereum`, which needs web3 < 8: we format it here, as
that library does, and recover the signer with eth-account.

The nonce is ours and stateless: 12 random hex digits and 20 of an HMAC (the server's
secret) over everything the challenge says and what it was issued for (the `binding`), so a
client can change none of it, nor move it to another resource, and nothing is written per
402. Single use is the caller's to keep (purchases.services.x402.sign_in). Only EOA
signatures (EIP-191) are checked; smart-contract wallets (EIP-1271/6492) need an RPC call
and are not accepted.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.utils.crypto import constant_time_compare, salted_hmac
from eth_account import Account
from eth_account.messages import encode_defunct
from eth_keys.exceptions import BadSignature
from eth_utils import exceptions as eth_errors
from eth_utils import is_address
from pydantic import ValidationError
from x402.extensions.sign_in_with_x import SIGN_IN_WITH_X, SIWxPayload, build_siwx_schema

from core.input_limits import JsonTooDeep, RefusedText, json_loads_bounded

__all__ = [
    "SIGN_IN_HEADER",
    "SIGN_IN_WITH_X",
    "SignIn",
    "SignInChallenge",
    "SignInRefused",
    "sign_in_declaration",
    "sign_in_verify",
    "siwe_message",
]

SIGN_IN_HEADER = "SIGN-IN-WITH-X"
# An honest proof is about 1.5 KB of base64; anything much larger is not one.
MAX_SIGN_IN_CHARS = 4_096
STATEMENT = "Sign in to fetch again what this wallet bought."
_NONCE_RANDOM_HEX = 12
_NONCE_MAC_HEX = 20  # 80 bits: a forged nonce is guessed once in 2**80 tries
_HMAC_SALT = "tollbooth.x402.sign-in-with-x"
# Clocks disagree a little: an issuedAt this far ahead of ours is still ours.
_CLOCK_SKEW = timedelta(seconds=30)


class SignInRefused(Exception):
    """The proof is not accepted; `reason` is a stable code (the SDK's `invalid_siwx_*`)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class SignInChallenge:
    """What a 402 asks to be signed: `uri` is the paid URL, `domain` its host, `chain_id`
    the CAIP-2 network (eip155:<n>) it may be signed for."""

    domain: str
    uri: str
    chain_id: str
    issued_at: datetime
    expires_at: datetime


@dataclass(frozen=True)
class SignIn:
    """A verified proof: `address` signed the challenge `nonce` for `uri`."""

    address: str
    nonce: str
    domain: str
    uri: str
    chain_id: str
    issued_at: datetime
    expires_at: datetime


def _timestamp(value: datetime) -> str:
    """EIP-4361 date-time, as the SDK writes it (UTC, milliseconds, Z)."""
    return value.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _mac(challenge_fields: list[str], binding: str, random_part: str) -> str:
    value = "\n".join([*challenge_fields, binding, random_part])
    return salted_hmac(_HMAC_SALT, value, algorithm="sha256").hexdigest()[:_NONCE_MAC_HEX]


def _fields(domain: str, uri: str, chain_id: str, issued_at: str, expires_at: str) -> list[str]:
    return [domain, uri, chain_id, issued_at, expires_at, STATEMENT]


def sign_in_declaration(*, challenge: SignInChallenge, binding: str) -> dict[str, Any]:
    """The 402's `extensions` entry: a fresh challenge whose nonce binds `binding` (what the
    caller issued it for) and every field the client will sign."""
    issued_at, expires_at = _timestamp(challenge.issued_at), _timestamp(challenge.expires_at)
    random_part = secrets.token_hex(_NONCE_RANDOM_HEX // 2)
    fields = _fields(challenge.domain, challenge.uri, challenge.chain_id, issued_at, expires_at)
    nonce = random_part + _mac(fields, binding, random_part)
    return {
        SIGN_IN_WITH_X: {
            "info": {
                "domain": challenge.domain,
                "uri": challenge.uri,
                "version": "1",
                "nonce": nonce,
                "issuedAt": issued_at,
                "expirationTime": expires_at,
                "statement": STATEMENT,
                "resources": [challenge.uri],
            },
            "supportedChains": [{"chainId": challenge.chain_id, "type": "eip191"}],
            "schema": build_siwx_schema(),
        }
    }


def siwe_message(payload: SIWxPayload) -> str:
    """The EIP-4361 text the client signed, exactly as `signinwithethereum` (5.x) prepares
    it from the same fields (SiweMessage.prepare_message)."""
    chain = payload.chain_id.removeprefix("eip155:")
    prefix = f"{payload.domain} wants you to sign in with your Ethereum account:\n{payload.address}"
    suffix = [
        f"URI: {payload.uri}",
        f"Version: {payload.version}",
        f"Chain ID: {chain}",
        f"Nonce: {payload.nonce}",
        f"Issued At: {payload.issued_at}",
    ]
    if payload.expiration_time:
        suffix.append(f"Expiration Time: {payload.expiration_time}")
    if payload.not_before:
        suffix.append(f"Not Before: {payload.not_before}")
    if payload.request_id is not None:
        suffix.append(f"Request ID: {payload.request_id}")
    if payload.resources is not None:
        suffix.append("\n".join(["Resources:", *(f"- {r}" for r in payload.resources)]))
    prefix = f"{prefix}\n\n{payload.statement}" if payload.statement is not None else prefix + "\n"
    return f"{prefix}\n\n" + "\n".join(suffix)


def _decode(header: str) -> SIWxPayload:
    value = header.strip()
    if len(value) > MAX_SIGN_IN_CHARS:
        raise SignInRefused("invalid_siwx_header", "SIGN-IN-WITH-X is too long.")
    try:
        document = json_loads_bounded(base64.b64decode(value.encode("utf-8"), validate=True))
        return SIWxPayload.model_validate(document)
    except (JsonTooDeep, RefusedText, binascii.Error, ValueError, ValidationError) as exc:
        # ValidationError is a ValueError; named for the reader.
        raise SignInRefused(
            "invalid_siwx_header", "SIGN-IN-WITH-X is not base64 JSON of a sign-in proof."
        ) from exc


def _parse_time(value: str | None, reason: str) -> datetime:
    try:
        parsed = datetime.fromisoformat((value or "").replace("Z", "+00:00"))
    except ValueError as exc:
        raise SignInRefused(reason, "A timestamp is not ISO 8601.") from exc
    if parsed.tzinfo is None:
        raise SignInRefused(reason, "A timestamp has no time zone.")
    return parsed


def sign_in_verify(
    *, header: str, domain: str, uri: str, chain_id: str, binding: str, now: datetime
) -> SignIn:
    """Check a SIGN-IN-WITH-X proof against what this URL asks (its `domain`, `uri` and
    `chain_id`, what its challenges are issued for: `binding`) and recover its signer.

    Raises SignInRefused: invalid_siwx_header, invalid_siwx_domain_mismatch,
    invalid_siwx_uri_mismatch, invalid_siwx_chain_id, invalid_siwx_nonce (not ours, or not
    for this resource and input), invalid_siwx_issued_at(_in_future), invalid_siwx_expired,
    invalid_siwx_signature.
    """
    payload = _decode(header)
    if payload.domain != domain:
        raise SignInRefused("invalid_siwx_domain_mismatch", "Signed for another domain.")
    if payload.uri != uri or payload.resources not in (None, [uri]):
        raise SignInRefused("invalid_siwx_uri_mismatch", "Signed for another resource.")
    if payload.chain_id != chain_id or payload.type != "eip191":
        raise SignInRefused("invalid_siwx_chain_id", "Signed for another chain.")
    issued_at = _parse_time(payload.issued_at, "invalid_siwx_issued_at")
    expires_at = _parse_time(payload.expiration_time, "invalid_siwx_expiration_time")
    if not _is_issued_by_us(payload, binding):
        raise SignInRefused(
            "invalid_siwx_nonce", "Not a challenge this URL issued for this request."
        )
    if issued_at > now + _CLOCK_SKEW:
        raise SignInRefused("invalid_siwx_issued_at_in_future", "issuedAt is in the future.")
    if expires_at <= now:
        raise SignInRefused("invalid_siwx_expired", "The challenge expired; sign a new one.")
    address = _recover(payload)
    return SignIn(
        address, payload.nonce, payload.domain, payload.uri, payload.chain_id, issued_at, expires_at
    )


def _is_issued_by_us(payload: SIWxPayload, binding: str) -> bool:
    """The nonce's MAC covers every field we declared, as we declared it, and `binding`:
    nothing was added (notBefore, requestId), changed or moved to another request."""
    fields = _fields(
        payload.domain,
        payload.uri,
        payload.chain_id,
        payload.issued_at,
        payload.expiration_time or "",
    )
    nonce = payload.nonce
    return (
        not payload.not_before
        and payload.request_id is None
        and payload.version == "1"
        and payload.statement == STATEMENT
        and len(nonce) == _NONCE_RANDOM_HEX + _NONCE_MAC_HEX
        and constant_time_compare(
            nonce[_NONCE_RANDOM_HEX:], _mac(fields, binding, nonce[:_NONCE_RANDOM_HEX])
        )
    )


def _recover(payload: SIWxPayload) -> str:
    if not is_address(payload.address):
        raise SignInRefused("invalid_siwx_signature", "The address is not an EVM address.")
    try:
        signer = Account.recover_message(
            encode_defunct(text=siwe_message(payload)), signature=payload.signature
        )
    except (ValueError, TypeError, eth_errors.ValidationError, BadSignature) as exc:
        raise SignInRefused("invalid_siwx_signature", "The signature is malformed.") from exc
    if signer.lower() != payload.address.lower():
        raise SignInRefused("invalid_siwx_signature", "The signature is not the address's.")
    return str(signer)
