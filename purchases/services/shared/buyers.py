"""Agent accounts and their API keys."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core.errors import DomainError, ErrorCode
from core.locks import lock_one
from payments.services import spend_in_window
from purchases.models import ApiKey, Buyer, BuyerWallet
from purchases.sql import API_KEY_BUYER

KEY_PREFIX = "tbk"


def _hash_key(raw_key: str) -> str:
    # Keys are 32 random bytes: a fast hash is enough, there is nothing to brute-force.
    return hashlib.sha256(raw_key.encode()).hexdigest()


@transaction.atomic
def buyer_create(
    *, name: str, spend_cap: int | None = None, wallets: list[str] | None = None
) -> Buyer:
    buyer = Buyer.objects.create(name=name, spend_cap=spend_cap)
    for address in wallets or []:
        BuyerWallet.objects.create(buyer=buyer, address=address.lower())
    return buyer


def api_key_issue(*, buyer: Buyer, label: str = "") -> str:
    """Create a key and return it in clear: the only time it is ever shown."""
    prefix = secrets.token_hex(6)
    raw_key = f"{KEY_PREFIX}_{prefix}_{secrets.token_urlsafe(32)}"
    ApiKey.objects.create(buyer=buyer, prefix=prefix, key_hash=_hash_key(raw_key), label=label)
    return raw_key


def api_key_authenticate(*, raw_key: str) -> Buyer | None:
    """The active buyer of an unrevoked key, or None (read from the database every time)."""
    parts = raw_key.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX:
        return None
    # A raw statement: the database's converters apply, without the ORM compiling the SQL.
    found = API_KEY_BUYER.fetch([parts[1]])
    if not found or not found[0].is_active:
        return None
    buyer = found[0]
    key_hash = str(buyer.__dict__.pop("api_key_hash"))
    if not hmac.compare_digest(key_hash, _hash_key(raw_key)):
        return None
    return buyer


def api_key_revoke(*, key: ApiKey) -> None:
    ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())


def buyer_spend_cap_check(
    *, buyer: Buyer, amount: int, now: datetime, purchase_ref: str | None = None
) -> None:
    """Lock the buyer row and refuse a payment past its cap, on any rail.

    The buyer row lock serializes payments of a capped buyer, so two cannot both fit under
    the cap. Taken in the one lock order (core.locks: after the quote and the purchase,
    before the balance the debit moves), FOR NO KEY UPDATE, so a refund credited to the same
    buyer at the same moment waits instead of deadlocking. Call it inside the payment's
    transaction. Raises DomainError: spend_cap_exceeded.
    """
    if buyer.spend_cap is None:
        return  # nothing to bound: no lock needed (the ledger locks its own balance row)
    lock_one(Buyer, buyer.pk)
    since = now - settings.TOLLBOOTH["SPEND_CAP_WINDOW"]
    if spend_in_window(buyer_id=buyer.pk, since=since) + amount > buyer.spend_cap:
        raise DomainError(ErrorCode.SPEND_CAP_EXCEEDED, purchase=purchase_ref)


def buyer_wallet_add(*, buyer: Buyer, address: str) -> BuyerWallet:
    """Register a wallet that pays for this buyer (spend caps, keyed quotes). Stored
    lower-case, so look-ups by payer never miss on case."""
    return BuyerWallet.objects.create(buyer=buyer, address=address.strip().lower())


def buyer_wallet_remove(*, wallet_id: int) -> None:
    BuyerWallet.objects.filter(pk=wallet_id).delete()
