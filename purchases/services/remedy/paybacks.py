"""Chain refunds closed on evidence, on the purchase's timeline (payments.paybacks judges).

Finance names a payback's transaction (or confirms a match the watch found); the chain is
asked with no lock held, then the purchase and the refund are locked and what it said is
recorded: closed, pending (looked at again), or refused with the failed check's code.
"""

from __future__ import annotations

import logging
from collections import Counter
from datetime import datetime

from django.db import transaction

from core.actors import Actor
from core.clock import now_or
from payments import paybacks
from payments.models import Refund
from payments.paybacks import PaybackRecorded, RefundPaybackRefused
from payments.rails.x402.chain import ChainUnavailable
from payments.rails.x402.networks import UnknownNetwork
from payments.safe_refunds import safe_exported_refunds
from purchases.events import event_record_change
from purchases.models import Purchase
from purchases.selectors import seller_wallets
from purchases.services.shared.job_runs import job_run

SAFE_BATCH_ACTOR = Actor.system("safe_batch_watch")

logger = logging.getLogger(__name__)


def purchase_refund_payback_close(
    *, refund_id: int, tx_hash: str, now: datetime | None, actor: Actor
) -> PaybackRecorded:
    """Close a chain refund by its payback's transaction, if the chain proves it; else
    record it pending (awaiting finality or the node: `verdict.pending`), looked at again
    by the payback watch.

    Raises RefundPaybackRefused (its `code` names the failed check) when the transaction
    does not pay this refund back, ValueError when the refund was paid by another one.
    """
    refund = Refund.objects.get(pk=refund_id)
    wallets = seller_wallets(network=refund.network)
    verdict = paybacks.refund_payback_verify(
        refund_id=refund_id, tx_hash=tx_hash, seller_wallets=wallets
    )
    with transaction.atomic():
        purchase = Purchase.objects.select_for_update().get(pk=refund.purchase_id)
        recorded = paybacks.refund_payback_record(
            refund_id=refund_id, verdict=verdict, by=actor.name or actor.type, now=now_or(now)
        )
        event_record_change(purchase=purchase, actor=actor, change=recorded.change)
    if not (recorded.verdict.closes or recorded.verdict.pending):
        raise RefundPaybackRefused(recorded.verdict)
    return recorded


def purchase_refund_match_confirm(
    *, refund_id: int, now: datetime | None, actor: Actor
) -> PaybackRecorded:
    """Finance's one click on a match the watch offered: the same checks as a pasted hash.
    Raises ValueError when the refund has no match (anymore), and as
    purchase_refund_payback_close."""
    match = Refund.objects.values_list("match_tx_hash", flat=True).get(pk=refund_id)
    if not match:
        raise ValueError("no payback match is offered for this refund")
    return purchase_refund_payback_close(refund_id=refund_id, tx_hash=match, now=now, actor=actor)


def refund_paybacks_watch(*, now: datetime | None = None) -> dict[str, int]:
    """The beat's look at the chain: pending paybacks due are judged again (closed once
    final), and owed chain refunds get a match offered when a transfer pays them back.
    Recorded as the job `refund_paybacks` (its lag is on /metrics with the others)."""
    now = now_or(now)
    with job_run("refund_paybacks", now) as stats:
        for key in ("closed", "pending", "dropped", "matched", "unavailable"):
            stats[key] = 0
        _recheck_due(now, stats)
        _offer_matches(now, stats)
    return dict(stats)


def _recheck_due(now: datetime, stats: Counter[str]) -> None:
    system = Actor.system("payback_watch")
    for refund_id in paybacks.refunds_payback_due(now=now):
        tx_hash = Refund.objects.values_list("payback_tx_hash", flat=True).get(pk=refund_id)
        try:
            recorded = purchase_refund_payback_close(
                refund_id=refund_id, tx_hash=tx_hash, now=now, actor=system
            )
        except (RefundPaybackRefused, ValueError):
            stats["dropped"] += 1
            continue
        stats["closed" if recorded.verdict.closes else "pending"] += 1


def _offer_matches(now: datetime, stats: Counter[str]) -> None:
    system = Actor.system("payback_watch")
    grouped = paybacks.unmatched_networks(paybacks.refunds_unmatched())
    for network, refunds in grouped.items():
        try:
            wallets = seller_wallets(network=network)
            found = paybacks.refund_payback_find(
                refunds=refunds, network=network, seller_wallets=wallets
            )
        except (ChainUnavailable, UnknownNetwork) as exc:
            logger.warning("payback watch: %s not searched: %s", network, exc)
            stats["unavailable"] += 1
            continue
        exported = safe_exported_refunds(network=network, refund_ids=[r.pk for r in refunds])
        for refund in refunds:
            if refund.pk not in found:
                continue
            transfer = found[refund.pk]
            if transfer.sender in exported.get(refund.pk, ()):
                _safe_batch_close(refund, transfer, now, stats)
            else:
                stats["matched"] += _match_record(refund, transfer, now, system)


def _safe_batch_close(
    refund: Refund, transfer: paybacks.Transfer, now: datetime, stats: Counter[str]
) -> None:
    """The Safe that a batch holding this refund was exported for sent its transfer: the
    batch was executed. Closed through the same verification as a pasted hash; not final
    yet, it is claimed and closed by a later run (_recheck_due)."""
    try:
        recorded = purchase_refund_payback_close(
            refund_id=refund.pk, tx_hash=transfer.tx_hash, now=now, actor=SAFE_BATCH_ACTOR
        )
    except (RefundPaybackRefused, ValueError) as exc:
        logger.warning("payback watch: refund %s not closed by %s: %s", refund.pk,
                       transfer.tx_hash, exc)  # fmt: skip
        stats["dropped"] += 1
        return
    stats["closed" if recorded.verdict.closes else "pending"] += 1


def _match_record(refund: Refund, transfer: paybacks.Transfer, now: datetime, actor: Actor) -> int:
    with transaction.atomic():
        purchase = Purchase.objects.select_for_update().get(pk=refund.purchase_id)
        change = paybacks.refund_match_record(refund_id=refund.pk, transfer=transfer, now=now)
        event_record_change(purchase=purchase, actor=actor, change=change)
    return int(change is not None)
