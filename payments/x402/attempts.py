"""x402 payment attempts: record before broadcast, then record what the chain said.

Called by the purchases orchestration, which holds the purchase row lock where noted and
puts the returned Change on the purchase's timeline.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from typing import Any

from django.db import connection, connections
from django.db.models import QuerySet

from core.changes import Change
from core.prepared import PreparedUpdate
from payments.models import LIVE_ATTEMPT_STATES, PaymentAttempt, Rail
from payments.x402.types import (
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
    signed = bool(prepared.tx_hash)
    meta = PaymentAttempt._meta
    values: list[tuple[str, Any]] = [("broadcast_started_at", now), ("updated_at", now)]
    if signed:
        values += [
            ("tx_hash", (prepared.tx_hash or "").lower()),
            ("raw_transaction", prepared.raw_transaction or ""),
            ("relayer_nonce", prepared.relayer_nonce),
        ]
    params = [meta.get_field(name).get_db_prep_save(value, connection) for name, value in values]  # type: ignore[union-attr]
    params.append(attempt_id)
    with connection.cursor() as cursor:
        cursor.execute(_mark_prepared_sql(connection.alias, connection.vendor, signed), params)


@functools.cache
def _mark_prepared_sql(alias: str, vendor: str, signed: bool) -> str:
    """x402_attempt_mark_prepared's UPDATE, written once per shape: every broadcast runs it.
    The first broadcast's time is kept (COALESCE); the signed transaction's fields are
    written only while none is (the CASE), so a later call never overwrites them."""
    quote = connections[alias].ops.quote_name

    def column(name: str) -> str:
        return quote(str(PaymentAttempt._meta.get_field(name).column))  # type: ignore[union-attr]

    started = column("broadcast_started_at")
    assignments = [f"{started} = COALESCE({started}, %s)", f"{column('updated_at')} = %s"]
    if signed:
        tx_hash = column("tx_hash")
        unsigned = f"({tx_hash} IS NULL OR {tx_hash} = '')"
        for name in ("tx_hash", "raw_transaction", "relayer_nonce"):
            assignments.append(
                f"{column(name)} = CASE WHEN {unsigned} THEN %s ELSE {column(name)} END"
            )
    table = quote(PaymentAttempt._meta.db_table)
    return f"UPDATE {table} SET {', '.join(assignments)} WHERE {column('id')} = %s"  # noqa: S608 - names from the model


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
