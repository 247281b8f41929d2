"""Finds rows that wait on a task whose enqueue may have been lost (on_commit is not durable)."""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.db.models import Q

from core.clock import now_or
from fulfillment.models import ExecutionAttempt
from purchases.models import Purchase


def purchases_awaiting_execution(*, now: datetime | None = None, limit: int = 500) -> list[int]:
    """Queued past the grace period, or running on an attempt whose lease has expired."""
    now = now_or(now)
    grace_cutoff = now - settings.TOLLBOOTH["SWEEP_GRACE"]
    expired_lease = ExecutionAttempt.objects.filter(
        state=ExecutionAttempt.State.RUNNING, lease_expires_at__lte=now
    ).values("purchase_id")
    ids = (
        Purchase.objects.filter(
            Q(fulfillment_state=Purchase.FulfillmentState.QUEUED, updated_at__lte=grace_cutoff)
            | Q(fulfillment_state=Purchase.FulfillmentState.RUNNING, pk__in=expired_lease)
        )
        .order_by("updated_at")
        .values_list("pk", flat=True)[:limit]
    )
    return list(ids)
