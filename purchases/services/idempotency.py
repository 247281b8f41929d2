"""Payment-id records with atomic phases (claim, do the work, store the answer).

A key is claimed in its own short transaction, so a concurrent request with the same key
sees it in flight instead of waiting on a lock. The answer is stored in the same
transaction as the work it describes, so "charged but no stored answer" cannot exist.
A record whose lease runs out (the process holding it died) is taken over by the next
request with that key, which resumes from whatever the database recorded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, transaction
from django.urls import reverse
from prometheus_client import Counter

from core.errors import DomainError, ErrorCode
from fulfillment import selectors as fulfillment_selectors
from purchases.models import IdempotencyRecord, Purchase

logger = logging.getLogger(__name__)

PAYMENT_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{16,128}")

payment_id_conflicts = Counter(
    "tollbooth_payment_identifier_conflicts_total",
    "Payment ids reused for a different request or principal (alert on any increase).",
    ["scope"],
)


@dataclass(frozen=True)
class StoredAnswer:
    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)
    purchase_ref: str | None = None
    # Live answers are recomputed from the purchase on every replay (x402 pending -> paid).
    is_live: bool = False
    # The body exactly as sent: replays are byte for byte, whatever jsonb does to key order.
    raw: bytes | None = None

    def __post_init__(self) -> None:
        if self.raw is None and self.body is not None:
            encoded = json.dumps(self.body, cls=DjangoJSONEncoder, ensure_ascii=False)
            object.__setattr__(self, "raw", encoded.encode())


@dataclass(frozen=True)
class KeyClaim:
    record_id: int
    lease_token: str
    replay: StoredAnswer | None = None


def payment_id_validate(*, key: str | None) -> str:
    """Raises DomainError: idempotency_key_missing, idempotency_key_invalid."""
    if not key:
        raise DomainError(ErrorCode.IDEMPOTENCY_KEY_MISSING)
    if not PAYMENT_ID_PATTERN.fullmatch(key):
        raise DomainError(ErrorCode.IDEMPOTENCY_KEY_INVALID)
    return key


def payment_id_hash(key: str) -> str:
    """What a payment id is kept as once its record is past retention."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def _refuse_if_compacted(*, scope: str, key: str, principal: str) -> None:
    """A retry after retention is answered with the receipt, never treated as a new sale."""
    record = (
        IdempotencyRecord.objects.select_related("purchase")
        .filter(scope=scope, key=payment_id_hash(key))
        .first()
    )
    if record is None:
        return
    if record.principal != principal:
        raise DomainError(ErrorCode.PAYMENT_IDENTIFIER_CONFLICT)
    receipt = (
        fulfillment_selectors.receipt_for_purchase(purchase_id=record.purchase.pk)
        if record.purchase
        else None
    )
    raise DomainError(
        ErrorCode.RETENTION_EXPIRED,
        purchase=record.purchase.ref if record.purchase else None,
        extra={
            "receipt": reverse("api:receipt-detail", kwargs={"public_id": receipt.public_id})
            if receipt
            else None
        },
    )


def payment_id_claim(
    *, scope: str, key: str, principal: str, fingerprint: str, now: datetime
) -> KeyClaim:
    """Claim a payment id, or learn that it already has an answer.

    Raises DomainError: payment_identifier_conflict, payment_in_flight, retention_expired.
    """
    _refuse_if_compacted(scope=scope, key=key, principal=principal)
    token = secrets.token_hex(8)
    lease_until = now + settings.TOLLBOOTH["IDEMPOTENCY_LEASE"]
    try:
        with transaction.atomic():
            record = IdempotencyRecord.objects.create(
                scope=scope,
                key=key,
                principal=principal,
                request_fingerprint=fingerprint,
                lease_token=token,
                locked_until=lease_until,
                created_at=now,
            )
            return KeyClaim(record.pk, token)
    except IntegrityError:
        pass  # the key exists: decide from what it recorded
    with transaction.atomic():
        record = (
            IdempotencyRecord.objects.select_for_update(of=("self",))
            .select_related("purchase")
            .get(scope=scope, key=key)
        )
        purchase_ref = record.purchase.ref if record.purchase else None
        if record.principal != principal or record.request_fingerprint != fingerprint:
            payment_id_conflicts.labels(scope=scope).inc()
            logger.warning(
                "payment id conflict scope=%s record=%s principal_matches=%s",
                scope,
                record.pk,
                record.principal == principal,
            )
            # Never name the other party's purchase: the key may not be this caller's.
            raise DomainError(ErrorCode.PAYMENT_IDENTIFIER_CONFLICT)
        if record.state == IdempotencyRecord.State.COMPLETED:
            stored = StoredAnswer(
                record.response_status or 500,
                record.response_body,
                dict(record.response_headers),
                purchase_ref,
                is_live=record.answer_is_live,
                raw=record.response_text.encode() if record.response_text else None,
            )
            return KeyClaim(record.pk, "", stored)
        if record.locked_until is not None and record.locked_until > now:
            raise DomainError(
                ErrorCode.PAYMENT_IN_FLIGHT,
                purchase=purchase_ref,
                retry_after=settings.TOLLBOOTH["RETRY_AFTER_SECONDS"],
            )
        # The request that held it died: take the lease and resume from the recorded state.
        logger.info("payment id lease taken over scope=%s record=%s", scope, record.pk)
        record.lease_token, record.locked_until = token, lease_until
        record.save(update_fields=["lease_token", "locked_until"])
        return KeyClaim(record.pk, token)


def payment_id_link_purchase(*, claim: KeyClaim, purchase: Purchase) -> None:
    """Name the purchase on the record as soon as it exists, for in-flight answers."""
    IdempotencyRecord.objects.filter(pk=claim.record_id, lease_token=claim.lease_token).update(
        purchase=purchase
    )


def payment_id_store_answer(
    *, claim: KeyClaim, answer: StoredAnswer, purchase: Purchase | None, now: datetime
) -> None:
    """Store the answer. Runs inside the transaction of the work it answers for."""
    with transaction.atomic():
        record = IdempotencyRecord.objects.select_for_update().get(pk=claim.record_id)
        if (
            record.lease_token != claim.lease_token
            or record.state != IdempotencyRecord.State.IN_FLIGHT
        ):
            # Our lease ran out and another request resumed: its answer stands, ours rolls back.
            raise DomainError(
                ErrorCode.PAYMENT_IN_FLIGHT,
                purchase=purchase.ref if purchase else None,
                retry_after=settings.TOLLBOOTH["RETRY_AFTER_SECONDS"],
            )
        if purchase is not None:
            record.purchase = purchase
        record.complete(status=answer.status, body=answer.body, headers=answer.headers, at=now)
        record.answer_is_live = answer.is_live
        record.response_text = answer.raw.decode() if answer.raw is not None else ""
        record.save(
            update_fields=[
                "state",
                "purchase",
                "response_status",
                "response_body",
                "response_text",
                "response_headers",
                "completed_at",
                "locked_until",
                "answer_is_live",
            ]
        )


def payment_id_release(*, claim: KeyClaim) -> None:
    """Give the key back unanswered (an unanticipated error): the next retry starts afresh."""
    IdempotencyRecord.objects.filter(
        pk=claim.record_id, lease_token=claim.lease_token, state=IdempotencyRecord.State.IN_FLIGHT
    ).update(locked_until=None)
