"""The one signature scheme (docs/webhooks.md, which holds the receiver's verifier).

    Tollbooth-Signature: t=<unix seconds>,kid=<key id>,v1=<hex HMAC-SHA256>[,kid=...,v1=...]

v1 is HMAC-SHA256 with the endpoint's secret over `<t>.<body bytes>`. During a rotation the
header carries one (kid, v1) pair per secret, the current first, so a receiver holding
either secret accepts it.
"""

from __future__ import annotations

import hashlib
import hmac

from django.conf import settings
from django.utils.crypto import salted_hmac

HEADER = "Tollbooth-Signature"
CALLBACK_SALT = "tollbooth.webhooks.callback-secret"


def signature_of(*, secret: bytes, timestamp: int, body: bytes) -> str:
    return hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def signature_header(*, keys: list[tuple[str, bytes]], timestamp: int, body: bytes) -> str:
    """The header's value for `keys` ((key id, secret), the current first)."""
    parts = [f"t={timestamp}"]
    for kid, secret in keys:
        parts += [f"kid={kid}", f"v1={signature_of(secret=secret, timestamp=timestamp, body=body)}"]
    return ",".join(parts)


def callback_secret(salt: str) -> str:
    """A buyer's callback secret: derived from WEBHOOKS["CALLBACK_SECRET_KEY"] (or SECRET_KEY)
    and the row's salt, so the database alone never holds a secret that signs."""
    key = settings.WEBHOOKS["CALLBACK_SECRET_KEY"] or settings.SECRET_KEY
    digest = salted_hmac(CALLBACK_SALT, salt, secret=key, algorithm="sha256").hexdigest()
    return f"whsec_{digest}"
