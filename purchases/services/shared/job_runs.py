"""Every background job records its runs: when, what it did, and the error if it failed."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

from core.clock import now_or
from purchases.models import JobRun

logger = logging.getLogger(__name__)


@contextmanager
def job_run(job: str, now: datetime) -> Iterator[Counter[str]]:
    """Record one run of a job: when, what it did, and the error if it failed."""
    run = JobRun.objects.create(job=job, started_at=now)
    stats: Counter[str] = Counter()
    try:
        yield stats
    except Exception as exc:
        JobRun.objects.filter(pk=run.pk).update(error=repr(exc)[:2000], stats=dict(stats))
        raise
    JobRun.objects.filter(pk=run.pk).update(finished_at=now_or(None), stats=dict(stats))
