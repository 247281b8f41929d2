"""x402 payment attempts: record before broadcast, then record what the chain said.

Called by the purchases orchestration, which holds the purchase row lock where noted and
puts the returned Change on the purchase's timeline.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.db.models import QuerySet

from core.changes import Change
from core.prepared import PreparedUpdate
from payments import sql
from payments.models import LIVE_ATTEMPT_STATES, PENDING_ATTEMPT_STATES, PaymentAttempt, Rail
from payments.rails.x402.types import (
    Authorization,
    PreparedBroadcast,
)


def x402_attempt_for_authorization(
    *, network: str, payer: str, nonce: str
) -> PaymentAttempt | None:
    """The live attempt this authorization already pays, if any."""
    return (
        PaymentAttempt.objects.select_related("purchase")
        .filter(
            network=network,
            payer=payer.lower(),
            authorization_nonce=nonce.lower(),
            state__in=LIVE_ATTEMPT_STATES,
        )
        .first()
    )


def x402_attempt_live(*, purchase_id: int) -> PaymentAttempt | None:
    return (
        PaymentAttempt.objects.filter(
            purchase_id=purchase_id,
            state__in=[PaymentAttempt.State.RECORDED, PaymentAttempt.State.SETTLEMENT_PENDING],
        )
        .order_by("-pk")
        .first()
    )


def x402_attempt_record(
    *,
    purchase_id: int,
    authorization: Authorization,
    idempotency_record_id: int,
    fingerprint: str,
    network: str,
    asset: str,
    search_from_block: int | None = None,
) -> tuple[PaymentAttempt, Change]:
    """Write the attempt with the signed authorization itself. Caller holds the purchase lock."""
    attempt = PaymentAttempt.objects.create(
        purchase_id=purchase_id,
        rail=Rail.X402,
        idempotency_record_id=idempotency_record_id,
        payer=authorization.payer.lower(),
        network=network,
        asset=asset,
        amount=authorization.value,
        fingerprint=fingerprint,
        authorization=authorization.as_wire(),
        authorization_nonce=authorization.nonce.lower(),
        valid_before_at=datetime.fromtimestamp(authorization.valid_before, tz=UTC),
        search_from_block=search_from_block,
    )
    change = Change(
        subject="payment_attempt",
        to_state=attempt.state,
        evidence={
            "attempt": attempt.pk,
            "rail": "x402",
            "payer": attempt.payer,
            "nonce": attempt.authorization_nonce,
            "valid_before": authorization.valid_before,
        },
    )
    return attempt, change


def _unclaimed_broadcast(
    attempt_id: int, now: datetime
) -> tuple[QuerySet[PaymentAttempt], dict[str, Any]]:
    unclaimed = PaymentAttempt.objects.filter(pk=attempt_id, broadcast_started_at__isnull=True)
    return unclaimed, {"broadcast_started_at": now}


# Every settlement's first statement, compiled once per process (core.prepared).
_FIRST_BROADCAST_CLAIM = PreparedUpdate(_unclaimed_broadcast, attempt_id=int, now=datetime)


def x402_attempt_claim_first_broadcast(*, attempt: PaymentAttempt, now: datetime) -> bool:
    """Claim the attempt's first broadcast (one conditional UPDATE): True for exactly one
    caller ever, who performs it; the others look the settlement up instead."""
    if not _FIRST_BROADCAST_CLAIM.run(attempt_id=attempt.pk, now=now):
        return False
    attempt.broadcast_started_at = now
    return True


def x402_attempt_mark_prepared(
    *, attempt: PaymentAttempt, prepared: PreparedBroadcast, now: datetime
) -> None:
    """Commit what we are about to broadcast (tx hash and signed bytes when known) first.

    One UPDATE: the first broadcast's time and the first signed transaction are kept;
    later calls never overwrite them. The instance is moved the same way, so the caller
    records the outcome without reading the row back.
    """
    attempt_id = attempt.pk
    if attempt.broadcast_started_at is None:
        attempt.broadcast_started_at = now
    if prepared.tx_hash and not attempt.tx_hash:
        attempt.tx_hash = prepared.tx_hash.lower()
        attempt.raw_transaction = prepared.raw_transaction or ""
        attempt.relayer_nonce = prepared.relayer_nonce
        attempt.relayer_address = prepared.relayer_address or ""
    signed = (
        (
            (prepared.tx_hash or "").lower(),
            prepared.raw_transaction or "",
            prepared.relayer_nonce,
            prepared.relayer_address or "",
        )
        if prepared.tx_hash
        else None
    )
    sql.attempt_mark_prepared(attempt_id=attempt_id, now=now, signed=signed)


def x402_attempt_claim_resubmission(
    *, attempt: PaymentAttempt, replacing_tx_hash: str, now: datetime
) -> bool:
    """Count the next resubmission before its relayer nonce is even allocated (write before
    broadcast): one conditional UPDATE, won by exactly one caller, and only while the
    attempt still names `replacing_tx_hash`. The instance is moved the same way."""
    number = attempt.resubmissions + 1
    won = PaymentAttempt.objects.filter(
        pk=attempt.pk,
        state__in=PENDING_ATTEMPT_STATES,
        resubmissions=number - 1,
        tx_hash=replacing_tx_hash.lower(),
    ).update(resubmissions=number, resubmitted_at=now, updated_at=now)
    if won:
        attempt.resubmissions, attempt.resubmitted_at = number, now
    return bool(won)


def x402_attempt_replace_prepared(
    *, attempt: PaymentAttempt, replacing_tx_hash: str, prepared: PreparedBroadcast, now: datetime
) -> bool:
    """Commit a fresh relayer transaction of the same authorization in place of
    `replacing_tx_hash`, whose relayer nonce another transaction took (so it can never be
    mined), before it is sent. Conditional on the attempt still naming that hash under the
    resubmission this caller claimed: False (nothing written) if anyone moved it since.
    The replaced hash stays on the timeline (the resubmission's event)."""
    written = PaymentAttempt.objects.filter(
        pk=attempt.pk,
        state__in=PENDING_ATTEMPT_STATES,
        resubmissions=attempt.resubmissions,
        tx_hash=replacing_tx_hash.lower(),
    ).update(
        tx_hash=(prepared.tx_hash or "").lower(),
        raw_transaction=prepared.raw_transaction or "",
        relayer_nonce=prepared.relayer_nonce,
        relayer_address=prepared.relayer_address or "",
        updated_at=now,
    )
    if written:
        attempt.tx_hash = (prepared.tx_hash or "").lower()
        attempt.raw_transaction = prepared.raw_transaction or ""
        attempt.relayer_nonce = prepared.relayer_nonce
        attempt.relayer_address = prepared.relayer_address or ""
    return bool(written)


def x402_attempt_authorization(*, attempt: PaymentAttempt) -> Authorization:
    wire = attempt.authorization or {}
    auth = wire.get("authorization", {})
    return Authorization(
        payer=auth["from"],
        to=auth["to"],
        value=int(auth["value"]),
        valid_after=int(auth["validAfter"]),
        valid_before=int(auth["validBefore"]),
        nonce=auth["nonce"],
        signature=wire["signature"],
    )


def x402_attempt_prepared(*, attempt: PaymentAttempt) -> PreparedBroadcast:
    """What was committed before the first broadcast: rebroadcasts send exactly this."""
    return PreparedBroadcast(
        tx_hash=attempt.tx_hash,
        raw_transaction=attempt.raw_transaction or None,
        relayer_nonce=attempt.relayer_nonce,
        relayer_address=attempt.relayer_address or None,
    )
