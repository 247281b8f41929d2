"""Telling people that money is owed: exactly once per refund, retried until it lands."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db.models import Q
from django.utils import timezone

from payments.models import Refund
from purchases.notify import Alert, AlertNotDelivered, alert_send

logger = logging.getLogger(__name__)
# A sender that claimed an alert and did not finish within this is presumed dead.
ALERT_CLAIM_LEASE = timedelta(minutes=10)


def _unsent() -> Q:
    stale = timezone.now() - ALERT_CLAIM_LEASE
    return Q(alerted_at__isnull=True) & (
        Q(alert_claimed_at__isnull=True) | Q(alert_claimed_at__lt=stale)
    )


def refund_alert(*, refund_id: int) -> bool:
    """Send the refund-owed alert unless it was already sent. Returns True if sent now.

    The claim is a conditional update, so two workers never both send it; a delivery
    failure gives the claim back, and a crashed sender's claim expires, for the sweeper.
    """
    claimed = Refund.objects.filter(_unsent(), pk=refund_id).update(alert_claimed_at=timezone.now())
    if not claimed:
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
    try:
        alert_send(alert)
    except AlertNotDelivered:
        Refund.objects.filter(pk=refund_id).update(alert_claimed_at=None)
        logger.exception("refund %s alert not delivered; the sweeper retries", refund_id)
        return False
    Refund.objects.filter(pk=refund_id).update(alerted_at=timezone.now())
    return True


def refunds_awaiting_alert(*, limit: int = 200) -> list[int]:
    return list(
        Refund.objects.filter(_unsent(), state=Refund.State.OWED)
        .order_by("pk")
        .values_list("pk", flat=True)[:limit]
    )
