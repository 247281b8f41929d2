"""Housekeeping jobs: quotes that expire or are purged, the running balances against the
ledger, payment ids past retention, alerts nobody sent. Each run is a JobRun; no bad row
stops a batch."""

from __future__ import annotations

import logging
from collections import Counter
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Max

from core.actors import Actor
from core.clock import now_or
from core.refs import payment_id_hash
from payments.models import Refund
from payments.services import ledger_balances_mismatched
from purchases.models import IdempotencyRecord, Offering, Quote
from purchases.selectors import escalations_awaiting_alert, refunds_awaiting_alert
from purchases.services.checkout.duplicates import duplicate_guards_prune
from purchases.services.quote.quotes import quote_expire, quotes_purge_expired_batch
from purchases.services.remedy.batches import row_isolated
from purchases.services.shared.alerts import (
    escalation_alert,
    refund_alert,
)
from purchases.services.shared.job_runs import job_run
from purchases.services.x402.sign_in import wallet_sign_ins_prune

logger = logging.getLogger(__name__)
# Duplicate guards are only lock rows: past the longest duplicate window nobody waits on one.
GUARD_KEEP = timedelta(days=1)


def _guard_keep() -> timedelta:
    """Guards outlive the longest duplicate window by an hour (see duplicate_guard_lock)."""
    longest = Offering.objects.aggregate(longest=Max("duplicate_window"))["longest"]
    return max(GUARD_KEEP, (longest or timedelta(0)) + timedelta(hours=1))


def expire_quotes(*, now: datetime | None = None, batch: int = 500) -> Counter[str]:
    """Close open quotes past their expiry and give their stock back."""
    now = now_or(now)
    failed: list[int] = []
    with job_run("expire_quotes", now) as stats:
        while True:
            with transaction.atomic():
                quotes = list(
                    Quote.objects.select_for_update(skip_locked=True)
                    .filter(state=Quote.State.OPEN, expires_at__lte=now)
                    .exclude(pk__in=failed)
                    .order_by("pk")[:batch]
                )
                for quote in quotes:
                    _expire_one(quote, now, stats, failed)
            if len(quotes) < batch:
                break
    return stats


def _expire_one(quote: Quote, now: datetime, stats: Counter[str], failed: list[int]) -> None:
    try:
        with transaction.atomic():  # a savepoint: one quote's failure keeps the others
            quote_expire(quote=quote, actor=Actor.system("reconciliation"))
        stats["expired"] += 1
    except Exception:
        logger.exception("expire_quotes: quote %s failed; the batch goes on", quote.pk)
        failed.append(quote.pk)
        stats["row_errors"] += 1
        stats[f"failed:quote:{quote.pk}"] += 1


def purge_expired_quotes(*, now: datetime | None = None, batch: int = 1000) -> Counter[str]:
    """Delete quotes that expired unpaid longer than QUOTE_PURGE_AFTER ago, batch by batch;
    with them the duplicate guards and the used sign-in nonces no longer needed."""
    now = now_or(now)
    with job_run("purge_quotes", now) as stats:
        while True:
            quotes, events = quotes_purge_expired_batch(
                expired_before=now - settings.TOLLBOOTH["QUOTE_PURGE_AFTER"], batch=batch
            )
            stats["purged"] += quotes
            stats["events_purged"] += events
            if quotes < batch:
                break
        stats["guards_pruned"] = duplicate_guards_prune(before=now - _guard_keep())
        stats["sign_ins_pruned"] = wallet_sign_ins_prune(now=now)
    return stats


def check_ledger_balances(*, now: datetime | None = None) -> Counter[str]:
    """The running prepaid balances against the append-only ledger: any difference is a bug
    or a hand edit, logged loudly and counted (`mismatched`); the ledger is the truth."""
    now = now_or(now)
    with job_run("ledger_balances", now) as stats:
        mismatches = ledger_balances_mismatched()
        for mismatch in mismatches:
            logger.error(
                "ledger balance mismatch buyer=%s asset=%s running=%s entries=%s",
                mismatch.buyer_id,
                mismatch.asset,
                mismatch.running,
                mismatch.from_entries,
            )
            stats[f"mismatch:{mismatch.buyer_id}:{mismatch.asset}"] = (
                mismatch.running - mismatch.from_entries
            )
        stats["mismatched"] = len(mismatches)
    return stats


def compact_payment_ids(*, now: datetime | None = None) -> Counter[str]:
    """Past retention a payment id keeps only its hash, principal and purchase (for the receipt)."""
    now = now_or(now)
    cutoff = now - settings.TOLLBOOTH["IDEMPOTENCY_RETENTION"]
    with job_run("compact_payment_ids", now) as stats:
        with transaction.atomic():
            due = list(
                IdempotencyRecord.objects.select_for_update(skip_locked=True).filter(
                    state=IdempotencyRecord.State.COMPLETED,
                    compacted_at__isnull=True,
                    created_at__lte=cutoff,
                )[:5000]
            )
            for record in due:
                record.key = payment_id_hash(record.key)
                record.response_body, record.response_headers, record.compacted_at = None, {}, now
                record.response_text = ""
            IdempotencyRecord.objects.bulk_update(
                due, ["key", "response_body", "response_text", "response_headers", "compacted_at"]
            )
        stats["compacted"] = len(due)
    return stats


def send_pending_alerts(*, now: datetime | None = None) -> Counter[str]:
    """Refund-owed and escalation alerts a crashed process never sent (or never tried)."""
    now = now_or(now)
    with job_run("alerts", now) as stats:
        for refund_id in refunds_awaiting_alert():
            with row_isolated(stats, "alerts", "refund", refund_id, None, now):
                stats["sent" if refund_alert(refund_id=refund_id) else "not_sent"] += 1
        for escalation_id in escalations_awaiting_alert():
            with row_isolated(stats, "alerts", "escalation", escalation_id, None, now):
                sent = escalation_alert(escalation_id=escalation_id)
                stats["escalations_sent" if sent else "escalations_not_sent"] += 1
        stats["owed_open"] = Refund.objects.filter(state=Refund.State.OWED).count()
    return stats
