"""After a paid purchase fails: a linked refund or a named escalation, never silence."""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.db import transaction

from core.actors import Actor
from core.errors import ErrorCode
from payments import services as payment_services
from payments.models import PaymentAttempt, Refund
from payments.rails import rail_for
from purchases.events import event_record, event_record_change
from purchases.models import Escalation, Offering, Purchase
from purchases.services.remedy.paybacks import purchase_refund_payback_close
from purchases.services.shared.alerts import alert_stage


def escalation_open(
    *,
    purchase: Purchase,
    owner: str,
    reason_code: str,
    now: datetime,
    actor: Actor,
    details: dict | None = None,
) -> Escalation:
    """Open (or return the already open) escalation for this purchase and reason."""
    existing = purchase.escalations.filter(
        reason_code=reason_code, state=Escalation.State.OPEN
    ).first()
    if existing is not None:
        return existing
    escalation = Escalation.objects.create(
        purchase=purchase,
        owner=owner,
        reason_code=reason_code,
        details=details or {},
        deadline_at=now + settings.TOLLBOOTH["ESCALATION_DEADLINE"],
    )
    event_record(
        subject="escalation",
        purchase=purchase,
        actor=actor,
        to_state=escalation.state,
        reason_code=reason_code,
        evidence={"escalation": escalation.pk, "owner": owner},
    )
    alert_stage(row=escalation, now=now)
    return escalation


def escalation_open_payment_reversed(
    *, purchase: Purchase, attempt: PaymentAttempt, now: datetime, actor: Actor
) -> Escalation:
    """Delivered, payment reversed (a reorg undid it for good): support owns it (ask the
    buyer to pay again, or write it off); its alert goes out through the outbox with the
    escalation. Caller holds the purchase's lock."""
    return escalation_open(
        purchase=purchase,
        owner=Escalation.OwnerRole.SUPPORT,
        reason_code=ErrorCode.PAYMENT_REVERSED.value,
        now=now,
        actor=actor,
        details={
            "attempt": attempt.pk,
            "tx_hash": attempt.tx_hash,
            "reorged_at": attempt.reorged_at.isoformat() if attempt.reorged_at else None,
            "why": attempt.reason_code,
            "payer": attempt.payer,
            "nonce": attempt.authorization_nonce,
            "fulfillment": purchase.fulfillment_state,
        },
    )


def escalation_resolve(
    *,
    escalation: Escalation,
    by: str,
    resolution: str,
    now: datetime,
    code: str = "",
    actor: Actor | None = None,
) -> Escalation:
    """Close an escalation with what was decided (`code`: one of RESOLUTION_CODES); a second
    call returns it unchanged. `actor`: who closed it on the timeline (staff `by` unless
    the system closed it on evidence, e.g. a later check found the work done).

    Raises ValueError without a resolution text.
    """
    if not resolution.strip():
        raise ValueError("say how the escalation was resolved")
    with transaction.atomic():
        escalation = (
            Escalation.objects.select_for_update().select_related("purchase").get(pk=escalation.pk)
        )
        if escalation.state == Escalation.State.RESOLVED:
            return escalation
        escalation.resolve(by=by, resolution=resolution, at=now, code=code)
        escalation.save(
            update_fields=["state", "resolved_by", "resolution", "resolved_at", "resolution_code"]
        )
        event_record(
            subject="escalation",
            purchase=escalation.purchase,
            actor=actor or Actor.staff(by),
            from_state=Escalation.State.OPEN,
            to_state=escalation.state,
            reason_code=escalation.reason_code,
            evidence={
                "escalation": escalation.pk,
                "resolution_code": code,
                "resolution": resolution,
            },
        )
    return escalation


def purchase_remedy_after_failure(
    *, purchase: Purchase, reason_code: str, is_known_failure: bool, now: datetime, actor: Actor
) -> None:
    """Apply the offering's policy to a paid purchase whose work failed. Caller holds the lock.

    An unknown outcome always escalates: refunding work that may have run is a guess.
    """
    attempt = payment_services.payment_attempt_settled(purchase_id=purchase.pk)
    if not is_known_failure or attempt is None:
        escalation_open(
            purchase=purchase,
            owner=Escalation.OwnerRole.SUPPORT,
            reason_code="execution_outcome_unknown" if not is_known_failure else reason_code,
            now=now,
            actor=actor,
            details={"execution_reason": reason_code},
        )
        return
    if purchase.offering.refund_policy == Offering.RefundPolicy.REFUND:
        try:
            purchase_refund_create(
                purchase=purchase,
                attempt=attempt,
                reason_code="execution_failed",
                now=now,
                actor=actor,
            )
        except payment_services.RefundExceedsSettled:
            # Staff refunded it in full already: nothing more is owed, and support says so.
            escalation_open(
                purchase=purchase,
                owner=Escalation.OwnerRole.SUPPORT,
                reason_code="execution_failed",
                now=now,
                actor=actor,
                details={"execution_reason": reason_code, "refund": "refunded in full already"},
            )
    else:
        escalation_open(
            purchase=purchase,
            owner=Escalation.OwnerRole.SUPPORT,
            reason_code="execution_failed",
            now=now,
            actor=actor,
            details={"execution_reason": reason_code},
        )


def purchase_refund_create(
    *,
    purchase: Purchase,
    attempt: PaymentAttempt,
    reason_code: str,
    now: datetime,
    actor: Actor,
    tx_hash: str | None = None,
) -> Refund:
    """A refund linked to the purchase and its payment, on the timeline. Caller holds the
    purchase lock. The rail gives the money back its way: prepaid money is credited back at
    once; on-chain money is owed."""
    refund, changes = rail_for(attempt.rail).refund(
        attempt=attempt,
        buyer_id=purchase.buyer_id,
        reason_code=reason_code,
        paid_by=actor.name or actor.type,
        now=now,
        tx_hash=tx_hash,
    )
    for change in changes:
        event_record_change(purchase=purchase, actor=actor, change=change)
    if refund.state == Refund.State.OWED:
        alert_stage(row=refund, now=now)
    return refund


def purchase_refund_mark_paid(
    *, refund_id: int, reference: str, now: datetime, actor: Actor
) -> Refund:
    """Finance paid a refund back: close it with the payment's reference, on the timeline.
    A chain refund's reference is its payback's transaction, judged on chain first
    (purchases.services.remedy.paybacks): it may come back still owed, its payback pending.

    Raises ValueError for an empty reference or one that differs from an earlier close, and
    RefundPaybackRefused (a ValueError) naming the failed check of a chain payback.
    """
    purchase_id, method = Refund.objects.values_list("purchase_id", "method").get(pk=refund_id)
    if method == Refund.Method.PAY_BACK:
        return purchase_refund_payback_close(
            refund_id=refund_id, tx_hash=reference, now=now, actor=actor
        ).refund
    with transaction.atomic():
        purchase = Purchase.objects.select_for_update().get(pk=purchase_id)
        refund, change = payment_services.refund_mark_paid(
            refund_id=refund_id, reference=reference, by=actor.name or actor.type, now=now
        )
        event_record_change(purchase=purchase, actor=actor, change=change)
    return refund
