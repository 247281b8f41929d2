"""How we prove who we are to a facilitator: the headers each call carries.

Three kinds, one per facilitator (docs/x402.md, "Authenticated facilitators"):

- `cdp`: a Coinbase Developer Platform Secret API key (`CDP_API_KEY_ID`,
  `CDP_API_KEY_SECRET`). Every call carries `Authorization: Bearer <JWT>` minted for that
  very call, as CDP's own SDKs mint it: header `alg` (EdDSA for an Ed25519 key, given as
  base64 of its 32-byte seed and 32-byte public key; ES256 for an EC P-256 key, given as
  PEM), `kid` = the key id, `typ` JWT, a random 16-digit `nonce`; claims `iss` "cdp", `sub` = the
  key id, `nbf` now, `exp` 120 s later, `uris` = ["<METHOD> <host[:port]><path>"] of the
  request (host and port as the configured URL's netloc spells them).
- `bearer`: a static `Authorization: Bearer <token>`.
- `header`: a static `<name>: <value>` (an API-key header).

No key, token or JWT is ever logged, put in an event or an error body: `FacilitatorAuth`
keeps them out of its repr, and a malformed secret is refused with a message naming the
setting, never its value.
"""

from __future__ import annotations

import base64
import binascii
import functools
import secrets
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from django.core.exceptions import ImproperlyConfigured

CDP = "cdp"
BEARER = "bearer"
HEADER = "header"
JWT_ISSUER = "cdp"
JWT_LIFETIME_SECONDS = 120  # CDP's SDKs mint for 120 s; the facilitator refuses longer ones
ED25519_SECRET_BYTES = 64  # seed (32) + public key (32), base64 as CDP issues it

PrivateKey = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey


class FacilitatorAuthInvalid(ImproperlyConfigured):
    """Credentials that cannot be used; the message names the setting, never the secret."""


@dataclass(frozen=True)
class FacilitatorAuth:
    """One facilitator's credentials. `secret` is the CDP key secret, the bearer token or
    the API-key header's value; never in a repr."""

    kind: str  # CDP, BEARER or HEADER
    secret: str = field(repr=False)
    key_id: str = ""  # CDP only
    header_name: str = ""  # HEADER only

    def headers(self, method: str, url: str) -> dict[str, str]:
        """The headers for one call of `method` to `url`."""
        if self.kind == CDP:
            return {"Authorization": f"Bearer {cdp_jwt(self, method, url)}"}
        if self.kind == BEARER:
            return {"Authorization": f"Bearer {self.secret}"}
        return {self.header_name: self.secret}


def facilitator_auth(raw: dict[str, Any] | None, *, where: str) -> FacilitatorAuth | None:
    """The credentials a settings block names (None: the facilitator takes calls without).

    `raw` holds `cdp_api_key_id`, `cdp_api_key_secret`, `bearer_token`, `api_key_header`,
    `api_key` (empty strings when unset); `where` names the settings in error messages.
    Raises FacilitatorAuthInvalid for half a CDP key, an unreadable one, half an API-key
    header, or more than one kind at once.
    """
    raw = raw or {}
    key_id = str(raw.get("cdp_api_key_id") or "").strip()
    key_secret = str(raw.get("cdp_api_key_secret") or "").strip()
    bearer = str(raw.get("bearer_token") or "").strip()
    header_name = str(raw.get("api_key_header") or "").strip()
    header_value = str(raw.get("api_key") or "").strip()
    kinds = [
        kind
        for kind, present in (
            (CDP, key_id or key_secret),
            (BEARER, bearer),
            (HEADER, header_name or header_value),
        )
        if present
    ]
    if len(kinds) > 1:
        raise FacilitatorAuthInvalid(f"{where}: set one facilitator credential, not {kinds}")
    if not kinds:
        return None
    if kinds == [CDP]:
        if not (key_id and key_secret):
            raise FacilitatorAuthInvalid(f"{where}: a CDP key needs both its id and its secret")
        private_key(key_secret, where=where)  # refuse an unreadable key at start, not per call
        return FacilitatorAuth(CDP, key_secret, key_id=key_id)
    if kinds == [BEARER]:
        return FacilitatorAuth(BEARER, bearer)
    if not (header_name and header_value):
        raise FacilitatorAuthInvalid(f"{where}: an API-key header needs its name and its value")
    if not _token_chars(header_name) or header_name.lower() in ("host", "content-length"):
        raise FacilitatorAuthInvalid(f"{where}: the API-key header's name is not usable")
    return FacilitatorAuth(HEADER, header_value, header_name=header_name)


def _token_chars(name: str) -> bool:
    return all(c.isalnum() or c in "-_" for c in name)


@functools.lru_cache(maxsize=16)
def private_key(secret: str, *, where: str = "CDP_API_KEY_SECRET") -> PrivateKey:
    """The signing key a CDP secret holds: PEM EC P-256, or base64 Ed25519 seed + public key.
    Raises FacilitatorAuthInvalid (naming `where`, never the secret)."""
    text = secret.strip().replace("\\n", "\n")  # a PEM pasted into one env line
    if text.startswith("-----BEGIN"):
        try:
            key = load_pem_private_key(text.encode(), password=None)
        except (ValueError, TypeError):
            raise FacilitatorAuthInvalid(f"{where}: not a readable PEM private key") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
            raise FacilitatorAuthInvalid(f"{where}: a PEM key must be EC P-256")
        return key
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != ED25519_SECRET_BYTES:
        raise FacilitatorAuthInvalid(
            f"{where}: neither PEM EC P-256 nor base64 of a 64-byte Ed25519 key"
        )
    key25519 = ed25519.Ed25519PrivateKey.from_private_bytes(raw[:32])
    public = key25519.public_key().public_bytes_raw()
    if public != raw[32:]:
        raise FacilitatorAuthInvalid(f"{where}: the Ed25519 key's two halves do not match")
    return key25519


def request_uri(method: str, url: str) -> str:
    """`"POST host[:port]/path"`: what the JWT's `uris` names (no scheme, no query)."""
    parts = urlsplit(url)
    return f"{method.upper()} {parts.netloc}{parts.path}"


def _nonce() -> str:
    # The form cdp-sdk sends (16 decimal digits; tests/x402/test_facilitator_auth_oracle.py),
    # drawn from `secrets`, not `random`.
    return "".join(secrets.choice("0123456789") for _ in range(16))


def cdp_jwt(auth: FacilitatorAuth, method: str, url: str, *, now: int | None = None) -> str:
    """A JWT for one call of `method` to `url`, valid from now for JWT_LIFETIME_SECONDS."""
    key = private_key(auth.secret)
    algorithm = "EdDSA" if isinstance(key, ed25519.Ed25519PrivateKey) else "ES256"
    issued = int(time.time()) if now is None else now
    claims = {
        "sub": auth.key_id,
        "iss": JWT_ISSUER,
        "nbf": issued,
        "exp": issued + JWT_LIFETIME_SECONDS,
        "uris": [request_uri(method, url)],
    }
    headers = {"kid": auth.key_id, "typ": "JWT", "nonce": _nonce()}
    return jwt.encode(claims, key, algorithm=algorithm, headers=headers)
