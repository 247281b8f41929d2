"""Celery interfaces: parse ids, make one domain call. Keyword-only ids, bounded retries."""

from __future__ import annotations

import logging
import socket
from typing import Any

from celery import shared_task

from purchases.services.fulfil.execution import ExecutionRetryable, purchase_execute
from purchases.services.fulfil.execution_recheck import (
    executions_recheck_due,
    purchase_execution_recheck,
)
from purchases.services.fulfil.sweeper import purchases_sweep_stalled
from purchases.services.jobs import housekeeping, reconcile
from purchases.services.remedy import paybacks, payout_reconcile
from purchases.services.settle import finality
from purchases.services.settle.authorization import authorizations_held_sweep
from purchases.services.settle.settlement import purchase_settle_attempt
from purchases.services.shared import outbox
from purchases.services.shared.alerts import (
    escalation_alert,
    facilitator_refused_alert,
    refund_alert,
)

logger = logging.getLogger(__name__)


def _worker_name(task: Any) -> str:
    return f"{task.request.hostname or socket.gethostname()}:{task.request.id}"


# No Celery retry limit: this task's retry count restarts with every task the sweeper sends.
# The database counts tries per execution and ends it (TOLLBOOTH_EXECUTION_MAX_TRIES and
# _DEADLINE_MINUTES) with an escalation, so the retries are bounded there.
@shared_task(bind=True, acks_late=True, max_retries=None)
def purchase_execute_task(self: Any, *, purchase_id: int) -> str:
    try:
        return purchase_execute(purchase_id=purchase_id, worker=_worker_name(self)).value
    except ExecutionRetryable as exc:
        raise self.retry(exc=exc, countdown=exc.retry_in) from exc


# A check is one poll (or one keyed start) and one write: a lost one is staged again by
# recheck_unknown_executions_task once its hold runs out, so no Celery retries here.
@shared_task(acks_late=True, soft_time_limit=120, time_limit=150)
def purchase_execution_recheck_task(*, purchase_id: int) -> str:
    return purchase_execution_recheck(purchase_id=purchase_id).value


# The settlement a captured authorization's terminal move staged (a backstop for the paying
# request, which settles at once if still there): a settled attempt is left alone, so a
# redelivery does nothing; an unknown outcome is reconciliation's.
@shared_task(acks_late=True, soft_time_limit=120, time_limit=150)
def payment_settle_captured_task(*, attempt_id: int) -> bool:
    return purchase_settle_attempt(attempt_id=attempt_id) is not None


@shared_task(acks_late=True)
def authorizations_held_sweep_task() -> int:
    stats = authorizations_held_sweep()
    return stats["captured"] + stats["released"]


@shared_task(acks_late=True)
def recheck_unknown_executions_task() -> int:
    return executions_recheck_due()["staged"]


@shared_task(acks_late=True)
def purchase_sweep_stalled_task() -> int:
    return purchases_sweep_stalled()["re_enqueued"]


@shared_task(acks_late=True)
def refund_alert_task(*, refund_id: int) -> bool:
    return refund_alert(refund_id=refund_id)


@shared_task(acks_late=True)
def escalation_alert_task(*, escalation_id: int) -> bool:
    return escalation_alert(escalation_id=escalation_id)


@shared_task(acks_late=True)
def facilitator_refused_alert_task(
    *, network: str, facilitator: str, endpoint: str, status: int
) -> bool:
    return facilitator_refused_alert(
        network=network, facilitator=facilitator, endpoint=endpoint, status=status
    )


# --- reconciliation (scheduled by beat; see CELERY_BEAT_SCHEDULE) ------------------------


@shared_task(acks_late=True)
def reconcile_pending_settlements_task() -> dict[str, int]:
    return dict(reconcile.reconcile_pending_settlements())


@shared_task(acks_late=True)
def watch_unfinal_settlements_task() -> dict[str, int]:
    return dict(finality.watch_unfinal_settlements())


@shared_task(acks_late=True)
def watch_failed_attempts_task() -> dict[str, int]:
    return dict(reconcile.watch_failed_attempts())


@shared_task(acks_late=True)
def finalize_failed_purchases_task() -> dict[str, int]:
    return dict(reconcile.finalize_failed_purchases())


@shared_task(acks_late=True)
def expire_quotes_task() -> dict[str, int]:
    return dict(housekeeping.expire_quotes())


@shared_task(acks_late=True)
def purge_expired_quotes_task() -> dict[str, int]:
    return dict(housekeeping.purge_expired_quotes())


@shared_task(acks_late=True)
def check_ledger_balances_task() -> dict[str, int]:
    return dict(housekeeping.check_ledger_balances())


@shared_task(acks_late=True)
def compact_payment_ids_task() -> dict[str, int]:
    return dict(housekeeping.compact_payment_ids())


@shared_task(acks_late=True)
def send_pending_alerts_task() -> dict[str, int]:
    return dict(housekeeping.send_pending_alerts())


@shared_task(acks_late=True)
def heal_relayers_task() -> dict[str, int]:
    return dict(reconcile.heal_relayers())


# One bounded JSON-RPC batch per direct-mode network; a lost run is the next tick's work.
@shared_task(acks_late=True, soft_time_limit=60, time_limit=90)
def relayer_funds_watch_task() -> dict[str, int]:
    return dict(reconcile.relayer_funds_watch())


# A run reads the chain with bounded RPC timeouts; a lost run is the next tick's work.
@shared_task(acks_late=True, soft_time_limit=240, time_limit=270)
def refund_paybacks_watch_task() -> dict[str, int]:
    return paybacks.refund_paybacks_watch()


# A send is one bounded RPC call; a lost one is the reconcile job's (it sends the same bytes).
@shared_task(acks_late=True, soft_time_limit=60, time_limit=90)
def payout_broadcast_task(*, payout_id: int) -> str:
    return payout_reconcile.payout_broadcast(payout_id=payout_id)


@shared_task(acks_late=True, soft_time_limit=240, time_limit=270)
def payouts_reconcile_task() -> dict[str, int]:
    return payout_reconcile.payouts_reconcile()


# --- the outbox (see OUTBOX_JOBS for the jobs it carries) --------------------------------


@shared_task(acks_late=True)
def outbox_relay_task() -> dict[str, int]:
    return dict(outbox.outbox_relay_due())


@shared_task(acks_late=True)
def outbox_prune_task() -> dict[str, int]:
    return dict(outbox.outbox_prune())
