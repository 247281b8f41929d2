"""Telling people: a refund owed or an escalation opened reaches a person exactly once,
and is retried until it does.

Each row is claimed by a conditional update (two workers never both send it), marked
delivered only after a backend that reaches a person took it, given back on failure,
and taken again if its sender died mid-send (the claim lease ran out).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.core.cache import cache
from django.db import transaction
from django.db.models import Model
from django.utils import timezone

from core.actors import Actor
from payments.models import Refund
from purchases import event_subjects as subjects
from purchases.events import event_record
from purchases.models import Escalation, Purchase
from purchases.notify import (
    ERROR_CHARS,
    Alert,
    AlertNotDelivered,
    AlertReport,
    alert_send_report,
)
from purchases.selectors import alert_unsent
from purchases.services.shared.outbox import outbox_stage

logger = logging.getLogger(__name__)


def alert_stage(*, row: Refund | Escalation, now: datetime) -> None:
    """The one way an alert is asked for: stage its job in the caller's transaction, with
    the row that calls for it (a refund now owed, an escalation opened); one job per row
    ever (its dedup key). `send_pending_alerts` sends what a crash left unsent."""
    if isinstance(row, Refund):
        job, kwargs = "refund_alert", {"refund_id": row.pk}
    else:
        job, kwargs = "escalation_alert", {"escalation_id": row.pk}
    outbox_stage(job=job, kwargs=kwargs, dedup_key=f"{job}:{row.pk}", now=now)


def _send_claimed(model: type[Model], pk: int, alert: Alert, purchase_id: int) -> bool:
    """Send (no transaction open), then record the outcome on the row and the timeline."""
    try:
        report = alert_send_report(alert)
    except AlertNotDelivered as failure:
        with transaction.atomic():
            model._default_manager.filter(pk=pk).update(alert_claimed_at=None)
            _note(purchase_id, alert, failure.report, error=str(failure))
        logger.exception("%s alert not delivered; the sweeper retries", alert.idempotency_key)
        return False
    with transaction.atomic():
        model._default_manager.filter(pk=pk).update(alerted_at=timezone.now())
        _note(purchase_id, alert, report)
    return True


def _note(purchase_id: int, alert: Alert, report: AlertReport | None, error: str = "") -> None:
    """Who was told, or who could not be: on the purchase's timeline."""
    evidence: dict[str, Any] = {"kind": alert.kind, "alert_key": alert.idempotency_key}
    if report is not None:
        evidence |= {
            "delivered_via": report.delivered,
            "failed": report.failed,
            "recipients": report.recipients,
        }
    if error:
        evidence["error"] = error[:ERROR_CHARS]
    event_record(
        subject=subjects.ALERT_FAILED if error else subjects.ALERT_SENT,
        purchase=Purchase(pk=purchase_id),
        actor=Actor.system("alerts"),
        reason_code=alert.kind,
        evidence=evidence,
    )


def _claim(model: type[Model], pk: int) -> bool:
    return bool(
        model._default_manager.filter(alert_unsent(), pk=pk).update(alert_claimed_at=timezone.now())
    )


def refund_alert(*, refund_id: int) -> bool:
    """Send the refund-owed alert unless it was already sent. Returns True if sent now."""
    if not _claim(Refund, refund_id):
        return False
    refund = Refund.objects.select_related("purchase").get(pk=refund_id)
    alert = Alert(
        kind="refund_owed",
        title=f"Refund owed: {refund.amount} of {refund.asset} to {refund.payer}",
        message=(
            f"Purchase {refund.purchase.ref}: {refund.reason_code}. Transaction "
            f"{refund.transaction or '-'} on {refund.network}. Pay it back and mark it paid "
            "in the admin (Refunds)."
        ),
        purchase_ref=refund.purchase.ref,
        amount=refund.amount,
        asset=refund.asset,
        details={
            "refund": refund.pk,
            "reason": refund.reason_code,
            "transaction": refund.transaction,
        },
        idempotency_key=f"tollbooth-refund-{refund.pk}",
    )
    return _send_claimed(Refund, refund_id, alert, refund.purchase_id)


def escalation_alert(*, escalation_id: int) -> bool:
    """Tell the escalation's owner that a purchase needs a person, once."""
    if not _claim(Escalation, escalation_id):
        return False
    escalation = Escalation.objects.select_related("purchase").get(pk=escalation_id)
    alert = Alert(
        kind="escalation",
        title=f"Escalated to {escalation.owner}: {escalation.reason_code}",
        message=(
            f"Purchase {escalation.purchase.ref} needs {escalation.owner} by "
            f"{escalation.deadline_at:%Y-%m-%d %H:%M} UTC. Resolve it in the admin (Escalations)."
        ),
        purchase_ref=escalation.purchase.ref,
        amount=escalation.purchase.amount,
        asset=escalation.purchase.asset,
        details={"escalation": escalation.pk, "owner": escalation.owner, **escalation.details},
        idempotency_key=f"tollbooth-escalation-{escalation.pk}",
    )
    return _send_claimed(Escalation, escalation_id, alert, escalation.purchase_id)


# --- a facilitator refusing our credentials ---------------------------------------------

FACILITATOR_REFUSED_JOB = "facilitator_refused_alert"
# One alert per facilitator, network and status this often (the metric counts every one).
FACILITATOR_REFUSED_EVERY_SECONDS = 3600


def facilitator_refused_stage(
    *, network: str, facilitator: str, endpoint: str, status: int, now: datetime | None = None
) -> bool:
    """A facilitator refused our credentials (HTTP 401/403; payments.rails.x402.facilitator
    sends `facilitator_refused`): stage an alert naming it and the status, at most one per
    facilitator, network and status per FACILITATOR_REFUSED_EVERY_SECONDS while the cache
    holds the mark (without the cache, one per refusal: louder, never silent). Returns
    whether one was staged."""
    now = now or timezone.now()
    bucket = int(now.timestamp()) // FACILITATOR_REFUSED_EVERY_SECONDS
    key = f"facilitator_refused:{network}:{facilitator}:{status}:{bucket}"[:200]
    try:
        if not cache.add(key, 1, timeout=FACILITATOR_REFUSED_EVERY_SECONDS):
            return False
    except Exception:  # the cache (Redis) unreachable: alert anyway
        logger.warning("facilitator refusal alert: cache unreachable, not throttled")
    kwargs = {"network": network, "facilitator": facilitator, "endpoint": endpoint}
    with transaction.atomic():
        staged = outbox_stage(
            job=FACILITATOR_REFUSED_JOB, kwargs={**kwargs, "status": status}, dedup_key=key, now=now
        )
    return staged is not None


def facilitator_refused_alert(
    *, network: str, facilitator: str, endpoint: str, status: int
) -> bool:
    """Tell operations that a facilitator refuses our credentials: payments on `network`
    answer 503 (nothing recorded) or stay pending until the key is fixed. Returns whether
    a backend that reaches a person took it."""
    hour = timezone.now().strftime("%Y%m%d%H")
    alert = Alert(
        kind="facilitator_credentials_refused",
        title=f"Facilitator {facilitator} refused our credentials: HTTP {status}",
        message=(
            f"{facilitator} answered HTTP {status} to /{endpoint} for {network}. Paid requests "
            "on this network are answered 503 (nothing recorded) and settlements already sent "
            "stay pending (reconciled on chain) until the facilitator accepts our key again: "
            "check the API key (CDP_API_KEY_ID / CDP_API_KEY_SECRET or the network's own), "
            "its scopes and whether it was revoked. See docs/x402.md, Authenticated facilitators."
        ),
        details={
            "network": network,
            "facilitator": facilitator,
            "endpoint": endpoint,
            "status": status,
        },
        idempotency_key=f"tollbooth-facilitator-refused-{network}-{facilitator}-{status}-{hour}",
    )
    try:
        alert_send_report(alert)
    except AlertNotDelivered:
        logger.exception("facilitator refusal alert not delivered")
        return False
    return True


def on_facilitator_refused(
    sender: object, *, network: str, facilitator: str, endpoint: str, status: int, **_: Any
) -> None:
    """Receiver of payments.rails.x402.facilitator.facilitator_refused (PurchasesConfig)."""
    try:
        facilitator_refused_stage(
            network=network, facilitator=facilitator, endpoint=endpoint, status=status
        )
    except Exception:  # never into the paying request: the metric has counted it
        logger.exception("facilitator refusal alert not staged")
