"""x402 payment attempts: record before broadcast, then record what the chain said.

Called by the purchases orchestration, which holds the purchase row lock where noted and
puts the returned Change on the purchase's timeline.
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.db import transaction

from core.changes import Change
from payments.models import LIVE_ATTEMPT_STATES, PaymentAttempt, Rail
from payments.x402.types import (
    Authorization,
    PreparedBroadcast,
    SettlementOutcome,
    SettlementStatus,
)

X402_SCOPE = "x402"


def x402_attempt_for_key(*, idempotency_record_id: int) -> PaymentAttempt | None:
    """The attempt recorded under this payment id, if its request got that far."""
    return (
        PaymentAttempt.objects.select_related("purchase")
        .filter(idempotency_record_id=idempotency_record_id)
        .first()
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


def x402_attempt_mark_prepared(
    *, attempt_id: int, prepared: PreparedBroadcast, now: datetime
) -> None:
    """Commit what we are about to broadcast (tx hash and signed bytes when known) first."""
    with transaction.atomic():
        attempt = PaymentAttempt.objects.select_for_update().get(pk=attempt_id)
        if attempt.broadcast_started_at is None:
            attempt.broadcast_started_at = now
        if prepared.tx_hash and not attempt.tx_hash:
            attempt.tx_hash = prepared.tx_hash.lower()
            attempt.raw_transaction = prepared.raw_transaction or ""
            attempt.relayer_nonce = prepared.relayer_nonce
        attempt.save(
            update_fields=[
                "broadcast_started_at",
                "tx_hash",
                "raw_transaction",
                "relayer_nonce",
                "updated_at",
            ]
        )


# What recording an outcome writes on the attempt (a bulk writer updates these columns).
OUTCOME_FIELDS = ("state", "tx_hash", "block_number", "settlement_reference", "reason_code")


def x402_attempt_apply_outcome(
    *, attempt: PaymentAttempt, outcome: SettlementOutcome, save: bool = True
) -> Change | None:
    """Move the attempt per the chain's answer. Returns what changed, or None.

    Idempotent: a second report of the same outcome writes nothing. Caller holds locks.
    `save=False` leaves the write of OUTCOME_FIELDS to a caller writing many attempts at once.
    """
    previous = attempt.state
    tx_hash = outcome.tx_hash.lower() if outcome.tx_hash else attempt.tx_hash
    if attempt.state in (PaymentAttempt.State.SUCCEEDED, PaymentAttempt.State.FAILED):
        return None
    if outcome.status == SettlementStatus.CONFIRMED:
        attempt.tx_hash = tx_hash
        attempt.block_number = outcome.block_number
        attempt.succeed(settlement_reference=tx_hash or "")
    elif outcome.status == SettlementStatus.FAILED:
        attempt.fail(reason_code=outcome.reason_code)
    elif attempt.state == PaymentAttempt.State.RECORDED:
        attempt.pend(tx_hash=tx_hash)
        attempt.reason_code = outcome.reason_code
    elif (tx_hash, outcome.reason_code) == (attempt.tx_hash, attempt.reason_code):
        return None  # still pending for the same reason: nothing new for the timeline
    else:
        attempt.tx_hash, attempt.reason_code = tx_hash, outcome.reason_code
    if save:
        attempt.save(update_fields=[*OUTCOME_FIELDS, "updated_at"])
    return Change(
        subject="payment_attempt",
        from_state=previous,
        to_state=attempt.state,
        reason_code=outcome.reason_code,
        evidence={
            "attempt": attempt.pk,
            "tx_hash": tx_hash,
            "block": outcome.block_number,
            **outcome.evidence,
        },
    )


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
    )
