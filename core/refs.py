"""Public references: agents never see integer primary keys."""

import hashlib
import re
import secrets


def new_ref(prefix: str) -> str:
    # 20 random bytes in base32-ish text: unguessable, URL-safe, sortable enough for humans.
    return f"{prefix}_{secrets.token_urlsafe(15).replace('-', 'x').replace('_', 'y')}"


# A client's payment id (Idempotency-Key, or the x402 payment-identifier extension's id).
PAYMENT_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{16,128}")


def payment_id_hash(key: str) -> str:
    """What a payment id is kept as once its record is past retention (a kernel function:
    selectors and services both look records up by it)."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()
