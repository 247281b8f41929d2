"""A settled x402 payment is watched until final; a reorg that undoes it is settled again.

Settled (the network's confirmation depth) is when the work may run; final (the network's
finality policy, payments.rails.x402.finality) is when no reorg can undo the transfer any more.
In between, the attempt stays `succeeded` with `final_at` empty and its next look at
`next_check_at`; `watch_unfinal_settlements` (beat) and the buyer's own resend or status URL
look again.

If the transfer is gone from the chain, the timeline says so (`payment_attempt.reorged`),
the attempt and the purchase are pending again, and the same signed authorization is
settled again at once through the rail (our relayer's identical bytes in direct mode, the
same payload to the facilitator in facilitator mode: purchases.services.settle.resubmit), which
EIP-3009 makes safe. If it can no longer land (window closed with its nonce unused, or the
nonce spent by a transfer that does not pay us), settlement records the failure as
"delivered, payment reversed" (`payment_reversed`) with an escalation and its alert
(purchases.services.settle.settlement).
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta
from itertools import groupby

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q

from core.actors import Actor
from core.clock import now_or
from payments.models import PaymentAttempt
from payments.rails.x402.attempts import x402_attempt_authorization
from payments.rails.x402.books_evidence import settlement_books_evidence_fill
from payments.rails.x402.chain import ChainReader
from payments.rails.x402.finality import Finality, FinalityCheck, settlement_finality
from payments.rails.x402.networks import network_config
from payments.rails.x402.types import NetworkConfig
from payments.services import payment_attempt_reopen
from purchases import event_subjects as subjects
from purchases.events import event_record, event_record_change, purchase_transition
from purchases.models import Escalation, Purchase
from purchases.services.fulfil.receipts import purchase_receipt_issue, settlement_mined_at
from purchases.services.remedy.batches import row_isolated
from purchases.services.remedy.remedies import escalation_open
from purchases.services.settle.settlement import settlement_follow_up, settlement_record_outcome
from purchases.services.shared.job_runs import job_run

REORGED = "settlement_reorged"
MOVED = "transfer_moved"
# Not final yet: look again at about the pace blocks come (the depth grows by itself).
FINALITY_RECHECK = timedelta(seconds=30)
# The chain did not answer: wait longer each time (the attempt stays watched).
UNANSWERED_BACKOFF = (timedelta(seconds=30), timedelta(minutes=2), timedelta(minutes=10))
# A claimed row is invisible to other runs this long; a crashed run's rows come back after it.
CLAIM = timedelta(minutes=5)
JOB = "settlement_finality"
# What the books read from a settlement's receipt and block, blanked when it moved.
_BOOKS_UNREAD = {"block_at": None, "gas_used": None, "effective_gas_price": None, "sent_by": ""}


def watch_unfinal_settlements(*, now: datetime | None = None, limit: int = 5000) -> Counter[str]:
    """Every settled x402 payment not yet final and due a look: final, still watched, moved,
    or undone (then settled again, or reversed)."""
    now = now_or(now)
    with job_run(JOB, now) as stats:
        attempts = _claim_due(now, limit)
        stats["claimed"] = len(attempts)
        for network_id, group in groupby(attempts, key=lambda a: a.network):
            network = network_config(network_id)
            reader = ChainReader(network)
            for attempt in group:
                with row_isolated(stats, JOB, "attempt", attempt.pk, attempt.purchase_id, now):
                    check = settlement_finality_follow(
                        attempt=attempt, now=now, network=network, reader=reader
                    )
                    stats[check.finality.value] += 1
                    if check.finality == Finality.FINAL and _final_recorded(attempt.pk):
                        stats["receipts_issued"] += 1
    return stats


def _final_recorded(attempt_id: int) -> bool:
    """Final now: the block's time is recorded (the settlement time a receipt states) and
    the signed receipt issued if the result exists (else it is signed as it is stored).
    True if a receipt was issued."""
    attempt = PaymentAttempt.objects.select_related("purchase__offering").get(pk=attempt_id)
    if settlement_mined_at(attempt=attempt) is None:
        return False  # the chain did not answer: the first answer after it issues the receipt
    return bool(purchase_receipt_issue(purchase=attempt.purchase, attempt=attempt))


def _claim_due(now: datetime, limit: int) -> list[PaymentAttempt]:
    with transaction.atomic():
        rows = list(
            PaymentAttempt.objects.select_for_update(skip_locked=True)
            .filter(rail="x402", state=PaymentAttempt.State.SUCCEEDED, final_at__isnull=True)
            .filter(Q(next_check_at__isnull=True) | Q(next_check_at__lte=now))
            .order_by("network", "pk")[:limit]
        )
        PaymentAttempt.objects.filter(pk__in=[row.pk for row in rows]).update(
            next_check_at=now + CLAIM
        )
    return rows


def settlement_finality_follow(
    *,
    attempt: PaymentAttempt,
    now: datetime,
    network: NetworkConfig | None = None,
    reader: ChainReader | None = None,
) -> FinalityCheck:
    """Look at one settled, not yet final attempt on chain and act on what is there.

    Call with no transaction open (chain reads, and possibly a resubmission)."""
    network = network or network_config(attempt.network)
    check = settlement_finality(
        authorization=x402_attempt_authorization(attempt=attempt),
        network=network,
        tx_hash=attempt.tx_hash,
        reader=reader or ChainReader(network),
        now=int(now.timestamp()),
        logs_from_block=attempt.search_from_block or 0,
    )
    if check.finality == Finality.UNDONE:
        _resettle(attempt, check, now)
    elif check.finality == Finality.UNKNOWN:
        _unanswered(attempt, check, now)
    else:
        _still_there(attempt, check, now)
    return check


def _unanswered(attempt: PaymentAttempt, check: FinalityCheck, now: datetime) -> None:
    """The chain could not say (unreadable, or the nonce used by nothing readable): the
    payment stays paid, looked at less often; unresolved past the reconciliation deadline
    since it settled, it gets an owner."""
    step = min(attempt.unanswered_checks, len(UNANSWERED_BACKOFF) - 1)
    PaymentAttempt.objects.filter(pk=attempt.pk).update(
        unanswered_checks=F("unanswered_checks") + 1,
        next_check_at=now + UNANSWERED_BACKOFF[step],
    )
    # `updated_at` is the settlement's save: the watch's own writes are plain UPDATEs.
    if now - attempt.updated_at <= settings.TOLLBOOTH["RECONCILIATION_DEADLINE"]:
        return
    with transaction.atomic():
        escalation_open(
            purchase=Purchase.objects.select_for_update().get(pk=attempt.purchase_id),
            owner=Escalation.OwnerRole.RECONCILIATION,
            reason_code="settlement_unresolved_reconciliation",
            now=now,
            actor=Actor.system("reconciliation"),
            details={
                "attempt": attempt.pk,
                "tx_hash": attempt.tx_hash,
                "finality": "unknown",
                "why": check.evidence.get("error") or (check.outcome and check.outcome.reason_code),
            },
        )


def _still_there(attempt: PaymentAttempt, check: FinalityCheck, now: datetime) -> None:
    """In the chain: final, or not yet (next look recorded). A transfer found in another
    block or transaction than recorded (re-mined after a reorg) is noted on the timeline."""
    # A facilitator's success names no block: learning it is not a move.
    moved = check.tx_hash != attempt.tx_hash or (
        attempt.block_number is not None and check.block_number != attempt.block_number
    )
    is_final = check.finality == Finality.FINAL
    with transaction.atomic():
        updated = PaymentAttempt.objects.filter(
            pk=attempt.pk, state=PaymentAttempt.State.SUCCEEDED, final_at__isnull=True
        ).update(
            tx_hash=check.tx_hash,
            settlement_reference=check.tx_hash or "",
            block_number=check.block_number,
            unanswered_checks=0,
            final_at=now if is_final else None,
            next_check_at=None if is_final else now + FINALITY_RECHECK,
            finality_seen=_seen(check, now),
            # Re-mined elsewhere: the old block's time and receipt are not this settlement's.
            **(_BOOKS_UNREAD if moved else {}),
        )
        if not updated:
            return  # lost the race: another look recorded it first
        purchase = Purchase(pk=attempt.purchase_id)
        evidence = {"attempt": attempt.pk, "tx_hash": check.tx_hash, **check.evidence}
        actor = Actor.system("reconciliation")
        if moved:
            event_record(
                subject=subjects.PAYMENT_REORGED,
                purchase=purchase,
                actor=actor,
                reason_code=MOVED,
                evidence={
                    **evidence,
                    "was_tx_hash": attempt.tx_hash,
                    "was_block": attempt.block_number,
                },
            )
        if is_final:
            event_record(
                subject=subjects.PAYMENT_FINAL, purchase=purchase, actor=actor, evidence=evidence
            )
    if is_final and (moved or attempt.block_at is None or not attempt.sent_by):
        # Its block can no longer change: the books take its time and gas now (no lock held).
        settlement_books_evidence_fill(attempts=PaymentAttempt.objects.filter(pk=attempt.pk))


def _seen(check: FinalityCheck, now: datetime) -> dict[str, int | str]:
    """How far from final the look found it, for the case file (purchases.case_checks)."""
    keys = ("policy", "block_number", "depth", "finality_depth", "finalized_block")
    seen = {key: check.evidence[key] for key in keys if key in check.evidence}
    return {**seen, "checked_at": int(now.timestamp())}


def _resettle(attempt: PaymentAttempt, check: FinalityCheck, now: datetime) -> None:
    """The transfer is gone: pending again, on the timeline; then the same authorization
    is settled again (or its failure recorded: a reversal) with no transaction open."""
    assert check.outcome is not None
    actor = Actor.system("reconciliation")
    if not _reopen(attempt, check, now, actor):
        return
    reopened = PaymentAttempt.objects.get(pk=attempt.pk)
    outcome = settlement_follow_up(attempt=reopened, outcome=check.outcome, now=now, actor=actor)
    settlement_record_outcome(
        attempt_id=attempt.pk, purchase_id=attempt.purchase_id, outcome=outcome, now=now
    )


def _reopen(attempt: PaymentAttempt, check: FinalityCheck, now: datetime, actor: Actor) -> bool:
    """Under the purchase's lock, then the attempt's. False if someone else moved or
    settled it again since `attempt` was read."""
    with transaction.atomic():
        purchase = (
            Purchase.objects.select_for_update(of=("self",))
            .select_related("offering")
            .get(pk=attempt.purchase_id)
        )
        locked = PaymentAttempt.objects.select_for_update().get(pk=attempt.pk)
        if locked.state != PaymentAttempt.State.SUCCEEDED or locked.final_at is not None:
            return False
        # Settled again since our look (a racing resend or beat reopened and resubmitted it,
        # possibly as the identical transaction): what we saw gone is not what is recorded.
        if (locked.updated_at, locked.block_number) != (attempt.updated_at, attempt.block_number):
            return False
        authorization = x402_attempt_authorization(attempt=locked)
        evidence = {
            "attempt": locked.pk,
            "tx_hash": locked.tx_hash,
            "block": locked.block_number,
            "payer": locked.payer,
            "nonce": locked.authorization_nonce,
            "valid_before": authorization.valid_before,
            "mode": network_config(locked.network).mode,
            "now_on_chain": check.outcome.reason_code if check.outcome else "",
            "head_block": check.evidence.get("head_block"),
        }
        change = payment_attempt_reopen(attempt=locked, reason_code=REORGED, now=now, evidence={})
        # Pending again: reconciliation's regular cadence (2.1), not this job's claim lease.
        PaymentAttempt.objects.filter(pk=locked.pk).update(
            next_check_at=now + FINALITY_RECHECK, unanswered_checks=0
        )
        event_record(
            subject=subjects.PAYMENT_REORGED,
            purchase=purchase,
            actor=actor,
            reason_code=REORGED,
            evidence=evidence,
        )
        event_record_change(purchase=purchase, actor=actor, change=change)
        if purchase.payment_state == Purchase.PaymentState.PAID:
            purchase_transition(
                purchase=purchase,
                transition=purchase.payment_reopen,
                actor=actor,
                arguments={"reason_code": REORGED},
                update_fields=["reason_code"],
                evidence={"tx_hash": locked.tx_hash, "network": locked.network},
            )
    return True
