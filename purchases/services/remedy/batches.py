"""No row a batch cannot process ever stops the batch: it is logged, counted, named in the
run's stats and put in front of support, and the next row goes on."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

from django.db import transaction

from core.actors import Actor
from purchases.models import Escalation, Purchase
from purchases.services.remedy.remedies import escalation_open

logger = logging.getLogger(__name__)


@contextmanager
def row_isolated(
    stats: Counter[str], job: str, kind: str, row_id: int, purchase_id: int | None, now: datetime
) -> Iterator[None]:
    """One row's failure never stops the batch: it is logged, counted, named in the run's
    stats and put in front of support, and the next row goes on."""
    try:
        yield
    except Exception as exc:
        logger.exception("%s: %s %s failed; the batch goes on", job, kind, row_id)
        stats["row_errors"] += 1
        stats[f"failed:{kind}:{row_id}"] += 1
        if purchase_id is not None:
            _escalate_row_failure(
                purchase_id=purchase_id, job=job, kind=kind, row_id=row_id, exc=exc, now=now
            )


def _escalate_row_failure(
    *, purchase_id: int, job: str, kind: str, row_id: int, exc: Exception, now: datetime
) -> None:
    try:
        with transaction.atomic():
            purchase = Purchase.objects.select_for_update().get(pk=purchase_id)
            escalation_open(
                purchase=purchase,
                owner=Escalation.OwnerRole.SUPPORT,
                reason_code="reconciliation_row_failed",
                now=now,
                actor=Actor.system("reconciliation"),
                details={"job": job, kind: row_id, "error": type(exc).__name__},
            )
    except Exception:  # the database itself is failing: the log line above is what is left
        logger.exception("%s: could not escalate the failure of %s %s", job, kind, row_id)
