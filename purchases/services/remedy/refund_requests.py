"""Refund requests from buyers: asked with an API key or signed by the paying wallet, decided
by staff in the back office. An approval is a refund proposal on the existing path (finance
approves it, then pays it out to the payer's wallet or credits the balance); a denial carries
a reason code the buyer reads. Every change is on the purchase's timeline (and so a webhook
event: refund_request.opened / refund_request.decided), in the transaction of the change.

Nothing here calls out: each service is one transaction under the purchase's row lock, so a
concurrent request with the same Idempotency-Key waits for the first and replays it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction

from core.actors import Actor
from core.canonical import canonical_json, sha256_hex
from core.clock import now_or
from core.errors import DomainError, ErrorCode
from core.locks import lock_one
from core.refs import PAYMENT_ID_PATTERN
from payments import services as payment_services
from payments.refund_request_signing import (
    SignedRequestInvalid,
    signed_request_parse,
    signed_request_signer,
)
from purchases import event_subjects as subjects
from purchases.events import event_record, event_record_change
from purchases.models import Purchase, RefundRequest

# The reason code of the refund proposal an approved request feeds (purchases.case_file).
BUYER_REFUND_REQUEST = "buyer_refund_request"
MAX_REASON = 1000


class RefundRequestRefused(Exception):
    """Staff may not make this decision now (decided already, or the money left to return
    changed since the request): the admin says why, nothing changed."""


@dataclass(frozen=True)
class RefundRequestOpened:
    request: RefundRequest
    created: bool


def _fingerprint(**fields: Any) -> str:
    return sha256_hex(canonical_json(fields))


def refund_request_open(
    *,
    purchase_id: int,
    channel: str,
    requested_by: str,
    amount: int,
    reason: str,
    idempotency_key: str,
    now: datetime | None = None,
    signed_message: dict[str, Any] | None = None,
    signature: str = "",
) -> RefundRequestOpened:
    """Open a refund request, or replay the one this Idempotency-Key opened (same request).
    The caller has established that `requested_by` is the payer.

    Raises DomainError: idempotency_key_invalid, idempotency_key_reused (same key, other
    request), refund_request_open (another is open), refund_not_available (nothing settled),
    refund_amount_exceeds_refundable, invalid_request (amount below 1, reason too long).
    """
    now = now_or(now)
    if not PAYMENT_ID_PATTERN.fullmatch(idempotency_key or ""):
        raise DomainError(ErrorCode.IDEMPOTENCY_KEY_INVALID)
    if amount < 1 or len(reason) > MAX_REASON:
        raise DomainError(
            ErrorCode.INVALID_REQUEST,
            f"amount must be at least 1 atomic unit; reason at most {MAX_REASON} characters",
        )
    fingerprint = _fingerprint(
        channel=channel, requested_by=requested_by.lower(), amount=str(amount), reason=reason
    )
    with transaction.atomic():
        purchase = lock_one(Purchase, purchase_id)
        replay = _replay(purchase, idempotency_key, fingerprint)
        if replay is not None:
            return RefundRequestOpened(replay, created=False)
        _check_room(purchase, amount)
        request = RefundRequest.objects.create(
            purchase=purchase,
            channel=channel,
            requested_by=requested_by,
            amount=amount,
            asset=purchase.asset,
            reason=reason,
            idempotency_key=idempotency_key,
            request_fingerprint=fingerprint,
            signed_message=signed_message or {},
            signature=signature,
            deadline_at=now + settings.TOLLBOOTH["REFUND_REQUEST_DEADLINE"],
        )
        event_record(
            subject=subjects.REFUND_REQUEST,
            purchase=purchase,
            actor=Actor.agent(requested_by),
            to_state=request.state,
            evidence={
                "refund_request": request.public_id,
                "amount": str(amount),
                "channel": channel,
                "reason": reason,
                "deadline_at": request.deadline_at.isoformat(),
            },
        )
    return RefundRequestOpened(request, created=True)


def _replay(purchase: Purchase, key: str, fingerprint: str) -> RefundRequest | None:
    existing = RefundRequest.objects.filter(purchase=purchase, idempotency_key=key).first()
    if existing is None:
        return None
    if existing.request_fingerprint != fingerprint:
        raise DomainError(ErrorCode.IDEMPOTENCY_KEY_REUSED, purchase=purchase.ref)
    return existing


def _check_room(purchase: Purchase, amount: int) -> None:
    """One open request per purchase; never above what was charged less what was refunded
    (proposed, owed or paid): the same sum refund_propose checks again at approval."""
    open_one = RefundRequest.objects.filter(
        purchase=purchase, state=RefundRequest.State.OPEN
    ).first()
    if open_one is not None:
        raise DomainError(
            ErrorCode.REFUND_REQUEST_OPEN,
            purchase=purchase.ref,
            extra={"refund_request": open_one.public_id},
        )
    attempt = payment_services.payment_attempt_settled(purchase_id=purchase.pk)
    if attempt is None:
        raise DomainError(ErrorCode.REFUND_NOT_AVAILABLE, purchase=purchase.ref)
    _settled, refundable = payment_services.refund_refundable(attempt_id=attempt.pk)
    if amount > refundable:
        raise DomainError(
            ErrorCode.REFUND_AMOUNT_EXCEEDS_REFUNDABLE,
            f"at most {max(refundable, 0)} atomic units are left to refund",
            purchase=purchase.ref,
            extra={"refundable": str(max(refundable, 0))},
        )


def refund_request_open_signed(
    *, ref: str, body: Any, now: datetime | None = None
) -> RefundRequestOpened:
    """The wallet path: a request signed (EIP-712, payments.refund_request_signing) by the
    wallet that paid purchase `ref`, for buyers without an API key.

    Raises DomainError: invalid_request (malformed, or it names another purchase),
    purchase_not_found, refund_request_expired, refund_request_signature_invalid (not the
    payer's signature, or a field changed), and refund_request_open's codes.
    """
    now = now_or(now)
    try:
        signed = signed_request_parse(body)
    except SignedRequestInvalid as exc:
        raise DomainError(ErrorCode.INVALID_REQUEST, str(exc)) from exc
    if signed.purchase != ref:
        raise DomainError(ErrorCode.INVALID_REQUEST, "the signed purchase is not this URL's")
    purchase = Purchase.objects.filter(ref=ref).first()
    if purchase is None:
        raise DomainError(ErrorCode.PURCHASE_NOT_FOUND)
    payer = _payer(purchase)
    try:
        signer = signed_request_signer(request=signed, network=purchase.network)
    except SignedRequestInvalid as exc:
        raise DomainError(
            ErrorCode.REFUND_REQUEST_SIGNATURE_INVALID, str(exc), purchase=ref
        ) from exc
    if signer is None or payer is None or signer.lower() != payer.lower():
        raise DomainError(ErrorCode.REFUND_REQUEST_SIGNATURE_INVALID, purchase=ref)
    latest = now.timestamp() + settings.TOLLBOOTH["REFUND_REQUEST_MAX_VALIDITY"].total_seconds()
    if not now.timestamp() < signed.expiry <= latest:
        # The same signed bytes sent again after their expiry (a retry after a timeout) are
        # the request they opened, never refused as a new one.
        sent = RefundRequest.objects.filter(
            purchase_id=purchase.pk,
            idempotency_key=signed.idempotency_key,
            signature=signed.signature,
        ).first()
        if sent is not None:
            return RefundRequestOpened(sent, created=False)
        raise DomainError(ErrorCode.REFUND_REQUEST_EXPIRED, purchase=ref)
    return refund_request_open(
        purchase_id=purchase.pk,
        channel=RefundRequest.Channel.WALLET_SIGNATURE,
        requested_by=signer,
        amount=signed.amount,
        reason=signed.reason,
        idempotency_key=signed.idempotency_key,
        now=now,
        signed_message=signed.message(),
        signature=signed.signature,
    )


def _payer(purchase: Purchase) -> str | None:
    # The wallet whose transfer settled: only it may ask for the money back by signature.
    attempt = payment_services.payment_attempt_settled(purchase_id=purchase.pk)
    return attempt.payer if attempt is not None else None


def _locked(request_id: int) -> tuple[Purchase, RefundRequest]:
    # The lock order: the purchase, then its request (then the payment, in refund_propose).
    purchase_id = RefundRequest.objects.values_list("purchase_id", flat=True).get(pk=request_id)
    purchase = lock_one(Purchase, purchase_id)
    request = RefundRequest.objects.select_for_update().get(pk=request_id)
    if request.state != RefundRequest.State.OPEN:
        raise RefundRequestRefused(f"{request.public_id} was already {request.state}")
    return purchase, request


def _record_decision(purchase: Purchase, request: RefundRequest, staff: str) -> None:
    event_record(
        subject=subjects.REFUND_REQUEST,
        purchase=purchase,
        actor=Actor.staff(staff),
        from_state=RefundRequest.State.OPEN,
        to_state=request.state,
        reason_code=request.denial_code,
        evidence={
            "refund_request": request.public_id,
            "amount": str(request.amount),
            "refund": request.refund_id,
            "note": request.decision_note,
        },
    )


def refund_request_approve(
    *, request_id: int, staff: str, note: str = "", now: datetime | None = None
) -> RefundRequest:
    """Approve an open request: a refund proposal of its amount (reason buyer_refund_request)
    that finance approves or declines as any other; the money goes back to the payer's
    wallet (another destination needs a second approver) or the prepaid balance.

    Raises RefundRequestRefused: decided already, more than is left to refund now, or a
    buyer-requested proposal is still awaiting finance.
    """
    now = now_or(now)
    with transaction.atomic():
        purchase, request = _locked(request_id)
        attempt = payment_services.payment_attempt_settled(purchase_id=purchase.pk)
        if attempt is None:
            raise RefundRequestRefused("no settled payment to return")
        try:
            refund, change = payment_services.refund_propose(
                attempt=attempt,
                amount=request.amount,
                reason_code=BUYER_REFUND_REQUEST,
                proposed_by=staff,
                note=f"{request.public_id}: {note}".strip(": "),
            )
        except ValueError as exc:
            raise RefundRequestRefused(str(exc)) from exc
        if change is None:
            raise RefundRequestRefused("a buyer-requested refund here still awaits finance")
        event_record_change(purchase=purchase, actor=Actor.staff(staff), change=change)
        request.approve(by=staff, at=now, refund_id=refund.pk, note=note)
        request.save(update_fields=["state", "decided_by", "decided_at", "refund", "decision_note"])
        _record_decision(purchase, request, staff)
    return request


def refund_request_deny(
    *, request_id: int, staff: str, code: str, note: str = "", now: datetime | None = None
) -> RefundRequest:
    """Deny an open request with a reason code from RefundRequest.DENIAL_CODES (the buyer
    reads it) and a note for the case. Raises RefundRequestRefused: an unknown code, or
    decided already."""
    now = now_or(now)
    if code not in RefundRequest.DENIAL_CODES:
        raise RefundRequestRefused(f"not a denial code: {code!r}")
    with transaction.atomic():
        purchase, request = _locked(request_id)
        request.deny(by=staff, at=now, code=code, note=note)
        request.save(
            update_fields=["state", "decided_by", "decided_at", "denial_code", "decision_note"]
        )
        _record_decision(purchase, request, staff)
    return request


def refund_requests_assign_to_me(*, request_ids: list[int], staff: str) -> int:
    """Put `staff` on open requests as the person working them; each change on its
    purchase's timeline. Returns how many changed."""
    changed = 0
    for pk in sorted(request_ids):
        with transaction.atomic():
            try:
                purchase, request = _locked(pk)
            except (RefundRequest.DoesNotExist, RefundRequestRefused):
                continue
            if request.assignee == staff:
                continue
            previous, request.assignee = request.assignee, staff
            request.save(update_fields=["assignee"])
            event_record(
                subject=subjects.REFUND_REQUEST_ASSIGNED,
                purchase=purchase,
                actor=Actor.staff(staff),
                evidence={
                    "refund_request": request.public_id,
                    "assignee": staff,
                    "previous_assignee": previous,
                },
            )
            changed += 1
    return changed
