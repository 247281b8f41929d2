"""Finds rows that wait on a job whose delivery may have been lost, and stages it again.

The outbox delivers a staged job at least once to the broker, but the broker and the worker
can still lose it (Redis restarted with the message queued, a worker killed mid-run); the
database still says what is owed, so this sweep stages the job again.
"""

from __future__ import annotations

import logging
from collections import Counter
from datetime import datetime

from django.db import transaction

from core.clock import now_or
from purchases.selectors import purchases_awaiting_execution
from purchases.services.shared.job_runs import job_run
from purchases.services.shared.outbox import outbox_stage, outbox_stage_many

logger = logging.getLogger(__name__)
EXECUTE_JOB = "purchase_execute"


def purchase_execution_key(purchase_id: int) -> str:
    """The dedup key of a purchase's staged execution: one waiting message per purchase."""
    return f"{EXECUTE_JOB}:{purchase_id}"


def purchase_execution_stage(*, purchase_id: int, now: datetime | None = None) -> int | None:
    """Stage the execution of a purchase in the caller's transaction (once per flow)."""
    return outbox_stage(
        job=EXECUTE_JOB,
        kwargs={"purchase_id": purchase_id},
        dedup_key=purchase_execution_key(purchase_id),
        now=now,
    )


def purchase_executions_stage(*, purchase_ids: list[int], now: datetime | None = None) -> None:
    """`purchase_execution_stage` for many purchases: a few INSERTs, one relay after commit."""
    if purchase_ids:
        outbox_stage_many(
            job=EXECUTE_JOB,
            messages=[({"purchase_id": pk}, purchase_execution_key(pk)) for pk in purchase_ids],
            now=now,
        )


def purchases_sweep_stalled(*, now: datetime | None = None) -> Counter[str]:
    """Stage the execution of every purchase awaiting one again (JobRun `executions`).

    A purchase whose execution is already staged and not yet relayed is not staged twice.
    Stat: `re_enqueued` (purchases found).
    """
    now = now_or(now)
    with job_run("executions", now) as stats:
        ids = purchases_awaiting_execution(now=now)
        with transaction.atomic():
            for purchase_id in ids:
                purchase_execution_stage(purchase_id=purchase_id, now=now)
        stats["re_enqueued"] = len(ids)
    if ids:
        logger.info("sweeper re-staged %d purchases", len(ids))
    return stats
