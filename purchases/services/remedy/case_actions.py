"""Staff actions from the purchase's case file. Each runs only when the case says it is safe
now (purchases.case_file.purchase_case) and puts the staff member on the timeline.

Network I/O (a chain look-up, a job-service poll) happens with no transaction open; the
outcome is recorded after, under the purchase lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction

from core.actors import Actor
from core.clock import now_or
from fulfillment import selectors as fulfillment_selectors
from payments import services as payment_services
from payments.models import PaymentAttempt, Refund
from payments.rails.x402.attempts import x402_attempt_live
from payments.rails.x402.networks import UnknownNetwork
from purchases.case_file import STAFF_RESOLUTION_CODES, Action, Case, purchase_case
from purchases.events import event_record, event_record_change
from purchases.models import Escalation, Purchase
from purchases.selectors import CaseRecords, purchase_capability_url, purchase_case_facts
from purchases.services.fulfil.execution_recheck import purchase_execution_recheck
from purchases.services.fulfil.sweeper import purchase_execution_stage
from purchases.services.remedy.remedies import escalation_open, escalation_resolve
from purchases.services.settle.finality import settlement_finality_follow
from purchases.services.settle.settlement import (
    purchase_queue_execution_if_due,
    purchase_settle_attempt,
)
from purchases.services.shared.alerts import alert_stage

RECHECKED = "case.settlement_rechecked"
RECONCILED = "case.execution_reconciled"
REDELIVERED = "case.result_redelivered"
ASSIGNED = "escalation.assigned"
STAFF_ESCALATED = "staff_escalated"
REFUND_REASONS = {"refund": "support_refund", "compensation": "support_compensation"}


class ActionNotSafe(Exception):
    """The purchase's state does not permit this action now (the admin answers 403)."""


@dataclass(frozen=True)
class ActionDone:
    message: str
    evidence: dict[str, Any]


def purchase_case_now(
    *, purchase: Purchase, now: datetime | None = None, records: CaseRecords | None = None
) -> Case:
    now = now_or(now)
    facts = purchase_case_facts(purchase=purchase, now=now, records=records)
    return purchase_case(facts, now=now)


def _require(purchase_id: int, action: Action, now: datetime) -> Purchase:
    """Raises ActionNotSafe unless the case offers `action` now."""
    purchase = Purchase.objects.select_related("offering", "quote").get(pk=purchase_id)
    if action not in purchase_case_now(purchase=purchase, now=now).actions:
        raise ActionNotSafe(f"{action.value} is not safe for {purchase.ref} now")
    return purchase


def _record(purchase_id: int, *, subject: str, staff: str, evidence: dict[str, Any]) -> None:
    with transaction.atomic():
        purchase = Purchase.objects.select_for_update().get(pk=purchase_id)
        event_record(
            subject=subject, purchase=purchase, actor=Actor.staff(staff), evidence=evidence
        )


def case_settlement_recheck(
    *, purchase_id: int, staff: str, now: datetime | None = None
) -> ActionDone:
    """Look the pending settlement up on chain now, exactly as reconciliation does, and
    record what it showed; a settled payment not final yet gets the finality watch's look
    instead. Never re-signs; resubmits the same authorization only as
    purchases.services.settle.resubmit allows (and after a reorg, as the watch does). Raises
    ActionNotSafe."""
    now = now_or(now)
    _require(purchase_id, Action.RECHECK_SETTLEMENT, now)
    attempt = x402_attempt_live(purchase_id=purchase_id)
    if attempt is None:
        return _finality_recheck(purchase_id, staff=staff, now=now)
    try:
        settled = purchase_settle_attempt(attempt_id=attempt.pk, now=now)
    except UnknownNetwork as exc:
        raise ActionNotSafe(f"network {exc} is not configured here") from exc
    outcome = settled.outcome if settled else None
    evidence = {
        "attempt": attempt.pk,
        "status": outcome.status.value if outcome else "already_final",
        "reason_code": outcome.reason_code if outcome else "",
        "tx_hash": (outcome.tx_hash if outcome else None) or attempt.tx_hash,
    }
    _record(purchase_id, subject=RECHECKED, staff=staff, evidence=evidence)
    return ActionDone(f"Settlement looked up: {evidence['status']}.", evidence)


def _finality_recheck(purchase_id: int, *, staff: str, now: datetime) -> ActionDone:
    """Settled, not final yet: the finality watch's own look, now (final, still watched, or
    undone by a reorg and settled again)."""
    attempt = PaymentAttempt.objects.filter(
        purchase_id=purchase_id, rail="x402", state=PaymentAttempt.State.SUCCEEDED,
        final_at__isnull=True,
    ).order_by("-pk").first()  # fmt: skip
    if attempt is None:
        raise ActionNotSafe("no settlement to look up: none pending, and the payment is final")
    try:
        check = settlement_finality_follow(attempt=attempt, now=now)
    except UnknownNetwork as exc:
        raise ActionNotSafe(f"network {exc} is not configured here") from exc
    evidence = {
        "attempt": attempt.pk,
        "status": check.finality.value,
        "tx_hash": check.tx_hash or attempt.tx_hash,
        **{k: v for k, v in check.evidence.items() if k in _FINALITY_EVIDENCE},
    }
    _record(purchase_id, subject=RECHECKED, staff=staff, evidence=evidence)
    return ActionDone(f"Settlement finality looked up: {check.finality.value}.", evidence)


_FINALITY_EVIDENCE = ("block_number", "depth", "finality_depth", "finalized_block", "policy")


def case_execution_reconcile(
    *, purchase_id: int, staff: str, now: datetime | None = None
) -> ActionDone:
    """Stalled work (queued or running past its check) is staged again: the next worker
    takes the lease over and polls the saved job ref, never starting a second job. Work
    whose outcome is unknown is checked at once, as the automatic check does: the executor
    is asked about the job and the answer recorded; work found done is stored and delivered
    and its escalation closes itself. Raises ActionNotSafe."""
    now = now_or(now)
    purchase = _require(purchase_id, Action.RECONCILE_EXECUTION, now)
    if purchase.fulfillment_state == Purchase.FulfillmentState.UNKNOWN:
        evidence = _inspect_job(purchase, staff)
        _record(purchase_id, subject=RECONCILED, staff=staff, evidence=evidence)
        return ActionDone(f"Job inspected: {evidence['job_status']}.", evidence)
    with transaction.atomic():
        locked = Purchase.objects.select_for_update().select_related("offering").get(pk=purchase_id)
        actor = Actor.staff(staff)
        if locked.fulfillment_state == Purchase.FulfillmentState.NOT_STARTED:
            purchase_queue_execution_if_due(purchase=locked, actor=actor)
        staged = purchase_execution_stage(purchase_id=purchase_id, now=now)
        evidence = {"fulfillment_state": str(locked.fulfillment_state), "staged": bool(staged)}
        event_record(subject=RECONCILED, purchase=locked, actor=actor, evidence=evidence)
    return ActionDone("Execution staged again; a worker resumes it from the saved job.", evidence)


def _inspect_job(purchase: Purchase, staff: str) -> dict[str, Any]:
    """The automatic check, now: the job is asked (never started twice) and what it says is
    recorded; work found done is stored and the escalation closes itself."""
    attempts = fulfillment_selectors.execution_attempts(purchase_id=purchase.pk)
    last = attempts[-1] if attempts else None
    if last is None:
        return {"job_ref": "", "job_status": "never_started"}
    outcome = purchase_execution_recheck(purchase_id=purchase.pk, actor=Actor.staff(staff))
    last.refresh_from_db(fields=["job_ref", "state"])
    return {"job_ref": last.job_ref, "job_status": outcome.value, "attempt": last.pk}


def case_result_redeliver(
    *, purchase_id: int, staff: str, now: datetime | None = None
) -> ActionDone:
    """The stored result is still kept and the payment condition holds: record it and hand
    staff the capability URL to send the buyer (it serves the result without an API key).
    Raises ActionNotSafe."""
    now = now_or(now)
    purchase = _require(purchase_id, Action.REDELIVER_RESULT, now)
    result = fulfillment_selectors.result_for_purchase(purchase_id=purchase_id)
    if result is None or not purchase.is_payment_sufficient_for_execution():
        raise ActionNotSafe("no deliverable result")
    evidence = {
        "sha256": result.sha256,
        "size": result.size,
        "kept_until": result.expires_at.isoformat(),
        # Absolute: support sends it as it is, from wherever the admin is reached.
        "url": settings.TOLLBOOTH_PUBLIC_URL + purchase_capability_url(purchase=purchase),
    }
    _record(purchase_id, subject=REDELIVERED, staff=staff, evidence=evidence)
    return ActionDone(f"Send the buyer this link: {evidence['url']}", evidence)


def case_assign(
    *,
    purchase_id: int,
    staff: str,
    owner: str,
    deadline_at: datetime,
    note: str,
    escalation_id: int | None = None,
    now: datetime | None = None,
) -> Escalation:
    """Give an open escalation (or a new one, reason `staff_escalated`) an owner, a
    deadline and a note. Raises ActionNotSafe for an unknown owner or a past deadline."""
    now = now_or(now)
    if owner not in Escalation.OwnerRole.values:
        raise ActionNotSafe(f"unknown owner {owner!r}")
    if deadline_at <= now:
        raise ActionNotSafe("the deadline must be in the future")
    _require(purchase_id, Action.ASSIGN, now)
    actor = Actor.staff(staff)
    with transaction.atomic():
        purchase = Purchase.objects.select_for_update().get(pk=purchase_id)
        open_ones = purchase.escalations.filter(state=Escalation.State.OPEN)
        escalation = open_ones.filter(pk=escalation_id).first() if escalation_id else None
        if escalation is None:
            escalation = escalation_open(
                purchase=purchase, owner=owner, reason_code=STAFF_ESCALATED, now=now, actor=actor
            )
        escalation = Escalation.objects.select_for_update().get(pk=escalation.pk)
        escalation.owner, escalation.deadline_at, escalation.note = owner, deadline_at, note
        escalation.assigned_by, escalation.assigned_at = staff, now
        escalation.save(
            update_fields=["owner", "deadline_at", "note", "assigned_by", "assigned_at"]
        )
        event_record(
            subject=ASSIGNED,
            purchase=purchase,
            actor=actor,
            reason_code=escalation.reason_code,
            evidence={
                "escalation": escalation.pk,
                "owner": owner,
                "deadline_at": deadline_at.isoformat(),
                "note": note,
            },
        )
    return escalation


def case_refund_propose(
    *,
    purchase_id: int,
    staff: str,
    kind: str,
    note: str,
    amount: int | None = None,
    now: datetime | None = None,
) -> ActionDone:
    """Propose returning the payment (`refund`, all that is left of it) or part of it
    (`compensation`); several may be proposed, never more in all than it settled. Nothing is
    owed until finance approves. Raises ActionNotSafe."""
    now = now_or(now)
    if kind not in REFUND_REASONS:
        raise ActionNotSafe(f"unknown kind {kind!r}")
    _require(purchase_id, Action.PROPOSE_REFUND, now)
    with transaction.atomic():
        purchase = Purchase.objects.select_for_update().get(pk=purchase_id)
        attempt = payment_services.payment_attempt_settled(purchase_id=purchase_id)
        if attempt is None:
            raise ActionNotSafe("no settled payment to return")
        try:
            _settled, refundable = payment_services.refund_refundable(attempt_id=attempt.pk)
            refund, change = payment_services.refund_propose(
                attempt=attempt,
                # A refund returns what is left after earlier partial refunds.
                amount=refundable if kind == "refund" else (amount or 0),
                reason_code=REFUND_REASONS[kind],
                proposed_by=staff,
                note=note,
            )
        except ValueError as exc:
            raise ActionNotSafe(str(exc)) from exc
        if change is None:
            # One open proposal per payment and kind (a database constraint).
            raise ActionNotSafe(f"a {kind} is already proposed here, awaiting finance")
        event_record_change(purchase=purchase, actor=Actor.staff(staff), change=change)
    return ActionDone(f"Proposed {kind} of {refund.amount}; finance approves it.", {})


def case_refund_decide(
    *, refund_id: int, approve: bool, staff: str, now: datetime | None = None
) -> ActionDone:
    """Finance approves (then it is owed; prepaid: credited at once) or declines a proposed
    refund. Raises ActionNotSafe when it is not a proposal any more."""
    now = now_or(now)
    refund = Refund.objects.get(pk=refund_id)
    _require(refund.purchase_id, Action.APPROVE_REFUND, now)
    with transaction.atomic():
        purchase = Purchase.objects.select_for_update().get(pk=refund.purchase_id)
        refund, changes = payment_services.refund_decide(
            refund_id=refund_id, approve=approve, by=staff, buyer_id=purchase.buyer_id, now=now
        )
        if not changes:
            raise ActionNotSafe("this refund was already decided")
        for change in changes:
            event_record_change(purchase=purchase, actor=Actor.staff(staff), change=change)
        if refund.state == Refund.State.OWED:
            alert_stage(row=refund, now=now)
    return ActionDone(f"Refund {refund.pk} is now {refund.state}.", {})


def case_resolve(
    *, escalation_id: int, staff: str, code: str, note: str, now: datetime | None = None
) -> Escalation:
    """Resolve an open escalation with a reason code from the list and a note.
    Raises ActionNotSafe for an unknown code or an escalation already resolved."""
    now = now_or(now)
    if code not in STAFF_RESOLUTION_CODES:
        # Unknown, or one only the system closes with (the executor's own answer).
        raise ActionNotSafe(f"not a resolution code a person may use: {code!r}")
    escalation = Escalation.objects.get(pk=escalation_id)
    if escalation.state != Escalation.State.OPEN:
        raise ActionNotSafe("already resolved")
    text = note.strip() or STAFF_RESOLUTION_CODES[code]
    return escalation_resolve(escalation=escalation, by=staff, resolution=text, now=now, code=code)


def escalations_assign_to_me(
    *, escalation_ids: list[int], staff: str, now: datetime | None = None
) -> int:
    """Put `staff` on open escalations as the person working them ("assign to me"); the
    owning role and deadline stay. Each change is on its purchase's timeline. Resolved ones,
    and ones already theirs, are left as they are. Returns how many changed."""
    now = now_or(now)
    changed = 0
    for pk in sorted(escalation_ids):
        with transaction.atomic():
            purchase_id = (
                Escalation.objects.filter(pk=pk).values_list("purchase_id", flat=True).first()
            )
            if purchase_id is None:
                continue
            # The lock order: the purchase, then its escalation.
            purchase = Purchase.objects.select_for_update().get(pk=purchase_id)
            escalation = Escalation.objects.select_for_update().get(pk=pk)
            if escalation.state != Escalation.State.OPEN or escalation.assignee == staff:
                continue
            previous = escalation.assignee
            escalation.assignee, escalation.assigned_by, escalation.assigned_at = staff, staff, now
            escalation.save(update_fields=["assignee", "assigned_by", "assigned_at"])
            event_record(
                subject=ASSIGNED,
                purchase=purchase,
                actor=Actor.staff(staff),
                reason_code=escalation.reason_code,
                evidence={"escalation": pk, "assignee": staff, "previous_assignee": previous},
            )
            changed += 1
    return changed
