"""Reconciliation jobs: every pending, stuck or late outcome ends somewhere, from evidence.

Each job is idempotent and safe on several workers at once: rows are claimed with
`SKIP LOCKED` (and, for settlements, by pushing their next check into the future), every
transition goes through the same locked services the request path uses, and each run is
recorded as a JobRun. The database is the source of truth; beat only makes it sooner.

No rail is named here: for each configured rail that settles after recording, its attempts
are looked up many at a time through the rail interface (`PaymentRail.lookup_many`),
followed up and recorded (payments.rails).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from itertools import groupby

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q

from core.actors import Actor
from core.clock import now_or
from payments.models import PaymentAttempt
from payments.rails import (
    FundsLow,
    RowGuard,
    SettlementOutcome,
    SettlementStatus,
    rail_for,
    rails,
    rails_settled_after_record,
)
from purchases.events import purchase_transition
from purchases.models import Escalation, Purchase, Quote
from purchases.notify import Alert, AlertNotDelivered, alert_send
from purchases.services.quote.offerings import offering_stock_release
from purchases.services.remedy.batches import row_isolated
from purchases.services.remedy.remedies import escalation_open
from purchases.services.settle.settlement import (
    SettlementToRecord,
    purchase_settle_attempt,
    settlement_follow_up,
    settlement_record_outcome,
    settlement_record_outcomes,
)
from purchases.services.shared.job_runs import job_run

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int], None]

# RPC or facilitator unreachable: look again after 30 s, 2 min, 10 min, 1 h, 6 h, then daily.
BACKOFF = (
    timedelta(seconds=30),
    timedelta(minutes=2),
    timedelta(minutes=10),
    timedelta(hours=1),
    timedelta(hours=6),
    timedelta(days=1),
)
# The chain answered "not yet" (mempool, confirmations): look again at the regular cadence.
RECHECK = timedelta(seconds=30)
# A claimed row is invisible to other runs this long; a crashed run's rows come back after it.
CLAIM = timedelta(minutes=5)
# Failed attempts are watched for a late landing until this long after their window closed.
LATE_WATCH = timedelta(hours=1)
PENDING_STATES = (PaymentAttempt.State.RECORDED, PaymentAttempt.State.SETTLEMENT_PENDING)


# --- pending settlements --------------------------------------------------------------


def reconcile_pending_settlements(
    *,
    now: datetime | None = None,
    limit: int = 20_000,
    chunk_size: int | None = None,
    progress: ProgressFn | None = None,
) -> Counter[str]:
    """Look every due pending settlement up through its rail, many at a time, and record
    what it shows. `chunk_size`: attempts per batched read (None: the rail's own)."""
    now = now_or(now)
    with job_run("pending_settlements", now) as stats:
        _resume_unbroadcast(now, stats)
        attempts = _claim_due(now, limit)
        stats["claimed"] = len(attempts)
        for (rail, _network), group in groupby(_by_rail(attempts), key=_rail_network):
            _reconcile_group(rail, list(group), now, stats, chunk_size, progress)
    return stats


def _resume_unbroadcast(now: datetime, stats: Counter[str]) -> None:
    """Attempts recorded but never broadcast (the process died in between): broadcast now."""
    cutoff = now - settings.TOLLBOOTH["SETTLEMENT_GRACE"]
    stale = PaymentAttempt.objects.filter(
        rail__in=rails_settled_after_record(),
        state=PaymentAttempt.State.RECORDED,
        broadcast_started_at__isnull=True,
        created_at__lte=cutoff,
    )
    for attempt_id, purchase_id in stale.values_list("pk", "purchase_id")[:100]:
        with row_isolated(stats, "pending_settlements", "attempt", attempt_id, purchase_id, now):
            purchase_settle_attempt(attempt_id=attempt_id, now=now)
            stats["resumed_unbroadcast"] += 1


def _claim_due(now: datetime, limit: int) -> list[PaymentAttempt]:
    grace_cutoff = now - settings.TOLLBOOTH["SETTLEMENT_GRACE"]
    with transaction.atomic():
        rows = list(
            PaymentAttempt.objects.select_for_update(skip_locked=True)
            .filter(
                rail__in=rails_settled_after_record(),
                state__in=PENDING_STATES,
                broadcast_started_at__lte=grace_cutoff,
            )
            .filter(Q(next_check_at__isnull=True) | Q(next_check_at__lte=now))
            # No join: FOR UPDATE would lock the purchases too, and only a resubmission
            # (rare) reads the quote, which it then loads.
            .order_by("network", "pk")[:limit]
        )
        PaymentAttempt.objects.filter(pk__in=[row.pk for row in rows]).update(
            next_check_at=now + CLAIM
        )
    return rows


def _rail_network(attempt: PaymentAttempt) -> tuple[str, str]:
    return attempt.rail, attempt.network


def _by_rail(attempts: list[PaymentAttempt]) -> list[PaymentAttempt]:
    """Each rail's attempts together, per network, in the order claimed (a stable sort)."""
    return sorted(attempts, key=_rail_network)


def _row_guard(stats: Counter[str], job: str, now: datetime) -> RowGuard:
    """Reconciliation's row isolation, for the rail's own per-attempt work."""

    @contextmanager
    def guard(attempt: PaymentAttempt) -> Iterator[None]:
        with row_isolated(stats, job, "attempt", attempt.pk, attempt.purchase_id, now):
            yield

    return guard


def _reconcile_group(
    rail: str,
    attempts: list[PaymentAttempt],
    now: datetime,
    stats: Counter[str],
    chunk_size: int | None,
    progress: ProgressFn | None,
) -> None:
    """One rail's attempts on one network: look up many, follow up, record."""
    job = "pending_settlements"
    found = rail_for(rail).lookup_many(
        attempts=attempts, now=now, guard=_row_guard(stats, job, now), chunk_size=chunk_size
    )
    if found.unreachable:
        _back_off_all(found.unreachable, now, stats)
    unchanged: dict[str, list[int]] = {}
    settled: list[SettlementToRecord] = []  # confirmed or failed: recorded in bulk below
    for attempt in attempts:
        if attempt.pk not in found.outcomes:
            continue  # unreadable (counted by the guard) or unreachable (backed off above)
        with row_isolated(stats, job, "attempt", attempt.pk, attempt.purchase_id, now):
            outcome = settlement_follow_up(
                attempt=attempt,
                outcome=found.outcomes[attempt.pk],
                now=now,
                actor=Actor.system("reconciliation"),
            )
            if "resubmission" in outcome.evidence:
                stats["resubmitted"] += 1
            if outcome.status != SettlementStatus.PENDING:
                settled.append(SettlementToRecord(attempt.pk, attempt.purchase_id, outcome))
            elif _is_news(attempt, outcome):
                _apply(attempt, outcome, now, stats)
            else:
                unchanged.setdefault(outcome.reason_code, []).append(attempt.pk)
                stats["still_pending"] += 1
                _escalate_if_overdue(attempt, now, stats)  # e.g. a used nonce nobody can trace
        if progress:
            progress(1)
    # One statement per reason for every row the chain said nothing new about: at 10 000
    # rows a locked transaction per row would cost minutes.
    for reason, ids in unchanged.items():
        PaymentAttempt.objects.filter(pk__in=ids).update(
            next_check_at=now + RECHECK, unanswered_checks=0, reason_code=reason
        )
    _record_settled(settled, now, stats)
    if not found.unreachable:
        stats["rpc_round_trips"] += found.round_trips


def _record_settled(settled: list[SettlementToRecord], now: datetime, stats: Counter[str]) -> None:
    """Confirmed and failed outcomes in a few statements per chunk; what the bulk writer
    leaves (a row it could not process, late money) goes one by one, each row isolated."""
    left = settlement_record_outcomes(rows=settled, now=now)
    left_ids = {id(row) for row in left}
    for row in settled:
        if id(row) not in left_ids:
            stats[row.outcome.status.value] += 1
    for row in left:
        with row_isolated(
            stats, "pending_settlements", "attempt", row.attempt_id, row.purchase_id, now
        ):
            settlement_record_outcome(
                attempt_id=row.attempt_id,
                purchase_id=row.purchase_id,
                outcome=row.outcome,
                now=now,
            )
            stats[row.outcome.status.value] += 1
            stats["recorded_one_by_one"] += 1


def _is_news(attempt: PaymentAttempt, outcome: SettlementOutcome) -> bool:
    """Anything for the timeline? Settled or failed, a chain outage, a newly known tx."""
    if outcome.status != SettlementStatus.PENDING or outcome.reason_code == "chain_unavailable":
        return True
    new_hash = bool(outcome.tx_hash) and (outcome.tx_hash or "").lower() != (attempt.tx_hash or "")
    return new_hash or attempt.state == PaymentAttempt.State.RECORDED


def _apply(
    attempt: PaymentAttempt, outcome: SettlementOutcome, now: datetime, stats: Counter[str]
) -> None:
    """A pending outcome with news: a chain outage, or a newly known transaction."""
    if outcome.reason_code == "chain_unavailable":
        _back_off(attempt, now, stats)
    else:
        PaymentAttempt.objects.filter(pk=attempt.pk).update(
            next_check_at=now + RECHECK, unanswered_checks=0
        )
        settlement_record_outcome(
            attempt_id=attempt.pk, purchase_id=attempt.purchase_id, outcome=outcome, now=now
        )  # notes a new tx hash
        stats["still_pending"] += 1
        _escalate_if_overdue(attempt, now, stats)  # e.g. a used nonce that nobody can trace


def _back_off(attempt: PaymentAttempt, now: datetime, stats: Counter[str]) -> None:
    """No answer from the chain: wait longer each time; past the deadlines, name an owner."""
    delay = BACKOFF[min(attempt.unanswered_checks, len(BACKOFF) - 1)]
    PaymentAttempt.objects.filter(pk=attempt.pk).update(
        unanswered_checks=F("unanswered_checks") + 1, next_check_at=now + delay
    )
    stats["backed_off"] += 1
    _escalate_if_overdue(attempt, now, stats)


def _back_off_all(attempts: list[PaymentAttempt], now: datetime, stats: Counter[str]) -> None:
    """A whole network unreadable: one UPDATE per backoff step, not one per row."""
    by_step: dict[int, list[int]] = {}
    for attempt in attempts:
        by_step.setdefault(min(attempt.unanswered_checks, len(BACKOFF) - 1), []).append(attempt.pk)
    for step, ids in by_step.items():
        PaymentAttempt.objects.filter(pk__in=ids).update(
            unanswered_checks=F("unanswered_checks") + 1, next_check_at=now + BACKOFF[step]
        )
    stats["backed_off"] += len(attempts)
    for attempt in attempts:
        _escalate_if_overdue(attempt, now, stats)


def _escalate_if_overdue(attempt: PaymentAttempt, now: datetime, stats: Counter[str]) -> None:
    """Past the deadlines an unresolved settlement gets an owner: reconciliation, then support."""
    # A settlement reopened by a reorg is unresolved since the reorg, not since its broadcast.
    waited = now - (attempt.reorged_at or attempt.broadcast_started_at or attempt.created_at)
    owners = [
        (settings.TOLLBOOTH["RECONCILIATION_DEADLINE"], Escalation.OwnerRole.RECONCILIATION),
        (settings.TOLLBOOTH["SUPPORT_DEADLINE"], Escalation.OwnerRole.SUPPORT),
    ]
    for deadline, owner in owners:
        if waited > deadline:
            _escalate(attempt.purchase_id, owner, f"settlement_unresolved_{owner}", now, attempt)
            stats[f"escalated_{owner}"] += 1


def _escalate(
    purchase_id: int, owner: str, reason: str, now: datetime, attempt: PaymentAttempt
) -> None:
    with transaction.atomic():
        purchase = Purchase.objects.select_for_update().get(pk=purchase_id)
        escalation_open(
            purchase=purchase,
            owner=owner,
            reason_code=reason,
            now=now,
            actor=Actor.system("reconciliation"),
            details={
                "attempt": attempt.pk,
                "tx_hash": attempt.tx_hash,
                "unanswered_checks": attempt.unanswered_checks + 1,
            },
        )


# --- late transfers and final failures ------------------------------------------------


def watch_failed_attempts(*, now: datetime | None = None, limit: int = 5000) -> Counter[str]:
    """Failed attempts whose authorization could still land (or just closed): did it?"""
    now = now_or(now)
    with job_run("late_settlements", now) as stats:
        watched = list(
            PaymentAttempt.objects.filter(
                rail__in=rails_settled_after_record(),
                state=PaymentAttempt.State.FAILED,
                valid_before_at__gte=now - LATE_WATCH,
            )
            .exclude(refunds__reason_code__in=["late_settlement", "duplicate_settlement"])
            .select_related("purchase__quote__offering")
            .order_by("network", "pk")[:limit]
        )
        for (rail, _network), group in groupby(_by_rail(watched), key=_rail_network):
            _watch_group(rail, list(group), now, stats)
    return stats


def _watch_group(
    rail: str, attempts: list[PaymentAttempt], now: datetime, stats: Counter[str]
) -> None:
    guard = _row_guard(stats, "late_settlements", now)
    found = rail_for(rail).lookup_many(attempts=attempts, now=now, guard=guard)
    stats["chain_unavailable"] += len(found.unreachable)
    for attempt in attempts:
        if attempt.pk not in found.outcomes:
            continue
        outcome = found.outcomes[attempt.pk]
        with guard(attempt):
            stats["watched"] += 1
            if outcome.status == SettlementStatus.CONFIRMED:
                settlement_record_outcome(
                    attempt_id=attempt.pk, purchase_id=attempt.purchase_id, outcome=outcome, now=now
                )
                stats["late_found"] += 1


def finalize_failed_purchases(*, now: datetime | None = None, limit: int = 1000) -> Counter[str]:
    """Failed purchases older than FAILED_FINAL_AFTER become void, but only when every
    authorization they received is provably unusable: its window has closed. A nonce spent
    elsewhere would prove it too, but that needs a chain read per authorization; waiting for
    the window is the conservative answer (a late transfer is still watched until then)."""
    now = now_or(now)
    cutoff = now - settings.TOLLBOOTH["FAILED_FINAL_AFTER"]
    with job_run("finalize_failed", now) as stats:
        candidates = Purchase.objects.filter(
            payment_state=Purchase.PaymentState.FAILED, updated_at__lte=cutoff
        )
        for purchase_id in candidates.values_list("pk", flat=True)[:limit]:
            with row_isolated(stats, "finalize_failed", "purchase", purchase_id, purchase_id, now):
                stats["voided" if _void_if_unusable(purchase_id, now) else "not_yet_final"] += 1
    return stats


def _void_if_unusable(purchase_id: int, now: datetime) -> bool:
    attempts = list(
        PaymentAttempt.objects.filter(
            purchase_id=purchase_id, rail__in=rails_settled_after_record()
        )
    )
    for attempt in attempts:
        if attempt.valid_before_at and attempt.valid_before_at > now:
            return False  # this authorization can still land: not provably failed yet
    with transaction.atomic():
        purchase = Purchase.objects.select_for_update().select_related("quote").get(pk=purchase_id)
        if purchase.payment_state != Purchase.PaymentState.FAILED:
            return False
        purchase_transition(
            purchase=purchase,
            transition=purchase.payment_void,
            actor=Actor.system("reconciliation"),
            arguments={"reason_code": "authorizations_unusable"},
            update_fields=["reason_code"],
            evidence={"attempts": [a.pk for a in attempts]},
        )
        _release_stock(purchase.quote)
    return True


def _release_stock(quote: Quote) -> None:
    if quote.holds_stock:
        Quote.objects.filter(pk=quote.pk).update(holds_stock=False)
        offering_stock_release(offering_id=quote.offering_id)


# --- rail housekeeping ----------------------------------------------------------------


def heal_relayers(*, now: datetime | None = None) -> Counter[str]:
    """Each rail's housekeeping that keeps later settlements from stalling behind a gap
    (x402: our relayers' nonce gaps, a dropped transaction or a nonce handed out by a
    process that died before sending)."""
    now = now_or(now)
    with job_run("heal_relayers", now) as stats:
        for rail in rails():
            rail.heal(now=now, stats=stats)
    return stats


def relayer_funds_watch(*, now: datetime | None = None) -> Counter[str]:
    """Each rail's own funds for moving money, read and kept where every process sees them
    (x402 direct: each relayer's gas balance); each newly low one is alerted, once per low
    spell (again at the next run if no backend delivered it)."""
    now = now_or(now)
    with job_run("relayer_funds_watch", now) as stats:
        for rail in rails():
            rail.funds_watch(now=now, alert=_funds_low_alert, stats=stats)
    return stats


def _funds_low_alert(low: FundsLow) -> bool:
    """Send the low-funds alert; True when a backend delivered it."""
    refusing = "" if low.can_settle else " It cannot pay for one settlement: payments are refused."
    alert = Alert(
        kind="relayer_gas_low",
        title=f"Relayer gas low on {low.network}",
        message=(
            f"Relayer {low.address} on {low.network} holds {low.balance} wei, below the "
            f"minimum of {low.minimum} wei (X402_<NET>_RELAYER_MIN_GAS).{refusing} "
            "Send it native gas; payments are taken again at the next reading."
        ),
        amount=low.balance,
        asset="native",
        details={
            "network": low.network,
            "address": low.address,
            "balance_wei": str(low.balance),
            "minimum_wei": str(low.minimum),
            "can_settle": low.can_settle,
            "read_at": low.read_at.isoformat(),
        },
        idempotency_key=f"tollbooth-relayer-gas-{low.network}-{low.address}-{low.read_at:%Y%m%d%H%M%S}",
    )
    try:
        alert_send(alert)
    except AlertNotDelivered:
        logger.warning("relayer gas alert for %s on %s not delivered", low.address, low.network)
        return False
    return True
