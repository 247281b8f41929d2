"""Idempotent requests: one wrapper for every payment, on every rail.

A key is claimed with one INSERT ... ON CONFLICT DO NOTHING (never a failing INSERT), so a
concurrent request with the same key sees it in flight instead of waiting on a lock. The
key records its recovery point, the last phase committed (started, payment recorded,
finished), so a retry that takes over a dead request's lease, or a completer, resumes
exactly there. The answer is stored in the same transaction as the work it describes, so
"charged but no stored answer" cannot exist. The payment id lives once, on the key:
payment attempts link to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from django.conf import settings
from django.db import Error as DatabaseFailure
from django.db import transaction
from django.urls import reverse
from prometheus_client import Counter

from core.actors import Actor
from core.errors import DomainError, ErrorCode
from core.refs import PAYMENT_ID_PATTERN, payment_id_hash
from fulfillment import selectors as fulfillment_selectors
from purchases import event_subjects as subjects
from purchases import sql
from purchases.events import event_record
from purchases.models import IdempotencyRecord, Purchase
from purchases.services.checkout.leases import (
    lease_abandoned,
    lease_done,
    lease_hold,
    lease_release_later,
    lease_token_new,
    lease_until,
)
from purchases.services.fulfil.receipts import signed_receipt_extra

logger = logging.getLogger(__name__)

payment_id_conflicts = Counter(
    "tollbooth_payment_identifier_conflicts_total",
    "Payment ids reused for a different request or principal (alert on any increase).",
    ["scope"],
)


@dataclass(frozen=True)
class StoredAnswer:
    """A payment id's recorded answer, replayed byte for byte when the request comes again.

    Opaque here: the API's answers (doors.x402.answers, prepaid_answers) decide its
    status, body and headers; this module only stores it with the work it answers for and
    hands it back.
    """

    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)
    purchase_ref: str | None = None
    # Live answers are recomputed from the purchase on every replay (x402 pending -> paid).
    is_live: bool = False
    # The body exactly as sent: replays are byte for byte, whatever jsonb does to key order.
    raw: bytes | None = None


@dataclass(frozen=True)
class KeyClaim:
    record_id: int
    lease_token: str
    replay: StoredAnswer | None = None
    # Where a taken-over request resumes: the last phase its predecessor committed.
    recovery_point: str = IdempotencyRecord.RecoveryPoint.STARTED
    is_new: bool = False


@dataclass(frozen=True)
class KeyedRequest:
    """One request under a payment id: who sent it, for what, and which outcomes are about
    the key itself (answered fresh each time, never stored as its answer).

    `fingerprint` is what the id binds to (stored with it): the normalized request, so a
    retry that re-signed the same payment is the same request. `fingerprint_alias`, if
    given, is also taken as the same request: the exact payload's hash, which is what keys
    recorded before the normalized fingerprint hold.
    """

    scope: str
    key: str
    principal: str
    fingerprint: str
    now: datetime
    unstored: frozenset[ErrorCode] = frozenset()
    fingerprint_alias: str | None = None

    def matches(self, stored_fingerprint: str) -> bool:
        return stored_fingerprint in (self.fingerprint, self.fingerprint_alias or self.fingerprint)


T = TypeVar("T")


def payment_id_validate(*, key: str | None) -> str:
    """Raises DomainError: idempotency_key_missing, idempotency_key_invalid."""
    if not key:
        raise DomainError(ErrorCode.IDEMPOTENCY_KEY_MISSING)
    if not PAYMENT_ID_PATTERN.fullmatch(key):
        raise DomainError(ErrorCode.IDEMPOTENCY_KEY_INVALID)
    return key


def _refuse_compacted(record: IdempotencyRecord, principal: str) -> None:
    """A retry after retention is answered with the receipt, never treated as a new sale."""
    if record.principal != principal:
        raise DomainError(ErrorCode.PAYMENT_IDENTIFIER_CONFLICT)
    purchase_ref = _purchase_ref(record)
    receipt = (
        fulfillment_selectors.receipt_for_purchase(purchase_id=record.purchase_id)
        if record.purchase_id
        else None
    )
    raise DomainError(
        ErrorCode.RETENTION_EXPIRED,
        purchase=purchase_ref,
        extra={
            "receipt": reverse("api:receipt-detail", kwargs={"public_id": receipt.public_id})
            if receipt
            else None,
            # The key is gone; the receipt is not: the answer carries it, signed.
            **signed_receipt_extra(receipt.signed if receipt else ""),
        },
    )


def payment_id_claim(*, request: KeyedRequest) -> KeyClaim:
    """Claim a payment id, or learn that it already has an answer.

    A new key costs one INSERT ... ON CONFLICT DO NOTHING (never a failing INSERT), which
    also refuses to insert beside the key's compacted form; a replay that INSERT (writing
    nothing) and one SELECT (an answered key never changes, so it needs no lock), which
    also puts the replay, conflict or post-retention request on the key's purchase's
    timeline (purchases.sql.payment_id_insert_or_known).
    Raises DomainError: payment_identifier_conflict, payment_in_flight, retention_expired.
    """
    hashed = payment_id_hash(request.key)
    token = lease_token_new()
    new = IdempotencyRecord(
        scope=request.scope,
        key=request.key,
        principal=request.principal,
        request_fingerprint=request.fingerprint,
        lease_token=token,
        locked_until=lease_until(request.now),
        created_at=request.now,
    )
    claimed, rows = sql.payment_id_insert_or_known(
        record=new,
        hashed=hashed,
        fingerprint_alias=request.fingerprint_alias or request.fingerprint,
    )
    if claimed is not None:
        lease_hold(token=token, record_id=claimed, now=request.now)
        return KeyClaim(claimed, token, is_new=True)
    known = {record.key: record for record in rows}
    record = known.get(request.key)
    if record is not None and record.state == IdempotencyRecord.State.COMPLETED:
        _refuse_if_another_request(record, request)
        return KeyClaim(record.pk, "", _stored(record), record.recovery_point)
    if record is None and hashed in known:
        _refuse_compacted(known[hashed], request.principal)
    return _claim_recorded(request, token)  # in flight, dead, or a racing first claim


def _purchase_ref(record: IdempotencyRecord) -> str | None:
    """The key's purchase's ref: read with the row (`purchase_ref`), or its loaded purchase."""
    if not record.purchase_id:
        return None
    noted = getattr(record, "purchase_ref", None)
    if noted:
        return str(noted)
    return record.purchase.ref if record.purchase else None


def _stored(record: IdempotencyRecord) -> StoredAnswer:
    return StoredAnswer(
        record.response_status or 500,
        record.response_body,
        dict(record.response_headers),
        _purchase_ref(record),
        is_live=record.answer_is_live,
        raw=record.response_text.encode() if record.response_text else None,
    )


def _is_another_request(record: IdempotencyRecord, request: KeyedRequest) -> bool:
    return record.principal != request.principal or not request.matches(record.request_fingerprint)


def _refuse_if_another_request(record: IdempotencyRecord, request: KeyedRequest) -> None:
    """Raises DomainError: payment_identifier_conflict (logged and counted, never the answer)."""
    if not _is_another_request(record, request):
        return
    raise _conflict(record, request)


def _conflict(record: IdempotencyRecord, request: KeyedRequest) -> DomainError:
    # By key family (x402, prepaid), not by each offering's key space.
    payment_id_conflicts.labels(scope=request.scope.split(":")[0]).inc()
    logger.warning(
        "payment id conflict scope=%s record=%s principal_matches=%s",
        request.scope,
        record.pk,
        record.principal == request.principal,
    )
    # Never name the other party's purchase: the key may not be this caller's.
    return DomainError(ErrorCode.PAYMENT_IDENTIFIER_CONFLICT)


def _claim_recorded(request: KeyedRequest, token: str) -> KeyClaim:
    with transaction.atomic():
        record = (
            IdempotencyRecord.objects.select_for_update(of=("self",))
            .select_related("purchase")
            .get(scope=request.scope, key=request.key)
        )
        refusal: DomainError | None = None
        if _is_another_request(record, request):
            refusal = _conflict(record, request)
        elif record.state == IdempotencyRecord.State.COMPLETED:
            return KeyClaim(record.pk, "", _stored(record), record.recovery_point)
        elif _lease_is_live(record, request.now):
            refusal = DomainError(
                ErrorCode.PAYMENT_IN_FLIGHT,
                purchase=record.purchase.ref if record.purchase else None,
                retry_after=settings.TOLLBOOTH["RETRY_AFTER_SECONDS"],
            )
        if refusal is None:
            return _take_over(record, request, token)
        _note_refusal(record, request, refusal)
    raise refusal


def _lease_is_live(record: IdempotencyRecord, now: datetime) -> bool:
    """Someone still works under this key: its lease is renewed (its holder's process
    lives, purchases/services/checkout/leases.py) and, if this process is the holder, one of its
    requests still holds it."""
    if record.locked_until is None or record.locked_until <= now:
        return False
    return not lease_abandoned(record.lease_token)


def _note_refusal(record: IdempotencyRecord, request: KeyedRequest, refusal: DomainError) -> None:
    """Put an in-flight answer or a conflict on the key's purchase's timeline (if the key
    names one yet), without changing that purchase. Runs under the key's lock."""
    if record.purchase is None:
        return
    is_conflict = refusal.code == ErrorCode.PAYMENT_IDENTIFIER_CONFLICT
    event_record(
        subject=subjects.PAYMENT_ID_CONFLICT if is_conflict else subjects.PAYMENT_ID_IN_FLIGHT,
        purchase=record.purchase,
        actor=Actor.agent(request.principal),
        reason_code=str(refusal.code),
        evidence={
            "scope": request.scope,
            "record": record.pk,
            "principal_matches": record.principal == request.principal,
            "request_matches": request.matches(record.request_fingerprint),
            "recovery_point": record.recovery_point,
            "lease_until": record.locked_until.isoformat() if record.locked_until else None,
        },
    )


def _take_over(record: IdempotencyRecord, request: KeyedRequest, token: str) -> KeyClaim:
    """The request that held the key died: take the lease and resume from its recovery point."""
    logger.info(
        "payment id lease taken over scope=%s record=%s at %s",
        request.scope,
        record.pk,
        record.recovery_point,
    )
    record.lease_token = token
    record.locked_until = lease_until(request.now)
    record.save(update_fields=["lease_token", "locked_until"])
    lease_hold(token=token, record_id=record.pk, now=request.now)
    return KeyClaim(record.pk, token, None, record.recovery_point)


def payment_id_mark_recorded(*, claim: KeyClaim, purchase: Purchase) -> None:
    """Recovery point: the payment is recorded (purchase and attempt committed with this).

    Names the purchase on the key at once, for in-flight answers. Runs in the recording
    transaction.
    """
    # The recording transaction's last write: its events go in the same statement.
    sql.payment_id_mark_recorded(
        record_id=claim.record_id, lease_token=claim.lease_token, purchase_id=purchase.pk
    )


def payment_id_store_answer(
    *, claim: KeyClaim, answer: StoredAnswer, purchase: Purchase | None, now: datetime
) -> None:
    """Store the answer. Runs inside the transaction of the work it answers for.

    One conditional UPDATE: the FSM transition computes the new values on the claimed state,
    and the WHERE clause (our lease, still in flight) is the lock.
    """
    record = IdempotencyRecord(pk=claim.record_id, state=IdempotencyRecord.State.IN_FLIGHT)
    record.complete(status=answer.status, body=answer.body, headers=answer.headers, at=now)
    values: dict[str, Any] = {
        "state": record.state,
        "response_status": record.response_status,
        "response_body": record.response_body,
        "response_headers": record.response_headers,
        "response_text": answer.raw.decode() if answer.raw is not None else "",
        "completed_at": record.completed_at,
        "locked_until": record.locked_until,
        "answer_is_live": answer.is_live,
        "recovery_point": IdempotencyRecord.RecoveryPoint.FINISHED,
        **({"purchase_id": purchase.pk} if purchase is not None else {}),
    }
    stored = IdempotencyRecord.objects.filter(
        pk=claim.record_id, lease_token=claim.lease_token, state=IdempotencyRecord.State.IN_FLIGHT
    ).update(**values)
    if not stored:
        # Our lease ran out and another request resumed: its answer stands, ours rolls back.
        raise DomainError(
            ErrorCode.PAYMENT_IN_FLIGHT,
            purchase=purchase.ref if purchase else None,
            retry_after=settings.TOLLBOOTH["RETRY_AFTER_SECONDS"],
        )


def payment_id_release(*, claim: KeyClaim) -> None:
    """Give the key back unanswered (an unanticipated error): the next retry starts afresh
    from its recovery point. If the database cannot be reached to say so, the release is
    sent when it can (purchases/services/checkout/leases.py); never raises for that."""
    try:
        IdempotencyRecord.objects.filter(
            pk=claim.record_id,
            lease_token=claim.lease_token,
            state=IdempotencyRecord.State.IN_FLIGHT,
        ).update(
            # The token goes too: a heartbeat renewing the lease at this instant then
            # matches nothing, instead of holding a released id for a few more beats.
            locked_until=None,
            lease_token="",
        )
    except DatabaseFailure as exc:
        logger.warning("payment id %s not released now, at the next beat: %r", claim.record_id, exc)
        lease_release_later(token=claim.lease_token, record_id=claim.record_id)


def ref_if_exists(ref: str | None) -> str | None:
    """A refusal rolled back the purchase it was about to create: never name that one."""
    return ref if ref and Purchase.objects.filter(ref=ref).exists() else None


class ClaimHeld:
    """A result of work under a key that keeps the key claimed, its lease held: the work
    goes on after a wait, under the key again (purchases.services.checkout.flow)."""


def payment_id_work(
    *,
    request: KeyedRequest,
    claim: KeyClaim,
    run: Callable[[], T],
    refused: Callable[[DomainError], StoredAnswer],
    render: Callable[[StoredAnswer, bool], T],
) -> T:
    """Run work under a claimed key, by the key's rules.

    `run` stores its own answer in the transaction of what it did. A DomainError it raises
    becomes the key's stored answer (as `refused(error)` answers it), except the codes about
    the key itself (request.unstored), which give the key back and propagate; anything
    unanticipated gives the key back and propagates (a 500, or a 503 when the database or
    broker is unreachable; then the key is given back as soon as the database answers), so
    the next retry starts afresh from the recovery point. A result that is ClaimHeld keeps
    the key claimed for the work that follows it, run here again.
    `render(answer, is_replay)` turns a stored answer into what the caller returns.
    """
    held = False
    try:
        try:
            result = run()
        except DomainError as error:
            if error.code in request.unstored:
                raise
            error.purchase = ref_if_exists(error.purchase)
            answer = refused(error)
            payment_id_store_answer(claim=claim, answer=answer, purchase=None, now=request.now)
            return render(answer, False)
        held = isinstance(result, ClaimHeld)
        return result
    except Exception:
        # Unanswered (a code about the key, a bug, the database gone): give the key back.
        payment_id_release(claim=claim)
        raise
    finally:
        if not held:
            lease_done(token=claim.lease_token)
