"""What the case file's Now box adds to its table row for the unfinished bad states: the next
automatic check that can move the purchase (from the very fields the jobs read), and the
words a row alone gets wrong. Pure, like purchases.case_file, which calls it.

- A running execution is not "being run by a worker" when its tries failed (the worker holds
  it over the backoff) or its lease ran out (the worker stopped renewing it).
- A pending settlement whose broadcast is known is not "never broadcast", and one stuck
  behind an earlier relayer transaction that was never mined says so.
- A failed payment says whether the buyer may still pay the quote or needs a new one.
- A result past retention is not "stored".
- A settled x402 payment is not final until the network's finality policy says so: the page
  names its block, how far from final the finality watch last saw it, and its next look.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from core.clock import utc_seconds
from core.errors import Owner
from purchases.case_facts import CaseFacts, UnfinalFact

# The beat schedule (config/settings/base.py) runs these; said here as support reads them.
SETTLEMENT_LOOK_UP = "settlement look-up by reconciliation (by tx hash and payer + nonce)"
STALLED_SWEEP = "stalled-work sweep (re-stages work nobody runs; every 30 s)"
LEASE_CHECK = "lease check: the sweep hands the work to another worker if the lease is not renewed"
NEXT_TRY = "the next try of the same work (the worker holds it over the backoff)"
VOID_SWEEP = "finalize sweep (every 15 min) marks it void once no authorization can land"
QUOTE_SWEEP = "quote expiry (expire-quotes, every minute): its stock is released"
RELAYER_HEAL = "relayer heal (every 5 min) fills the gap"
EXECUTION_RECHECK = (
    "unknown-execution check (recheck-unknown-executions): polls the saved job; the "
    "escalation closes itself when the work turns out done"
)
HEAL_EVERY = timedelta(minutes=5)
FINALITY_WATCH = (
    "finality watch (watch-unfinal-settlements, every 30 s): looks the transfer up on chain; "
    "if a reorg undid it, the same signed authorization is settled again"
)


@dataclass(frozen=True)
class Said:
    """The Now box's additions: a sentence replacing the row's, notes, the next check."""

    sentence: str = ""
    notes: tuple[str, ...] = ()
    next_check_at: datetime | None = None
    next_check: str = ""


def case_said(facts: CaseFacts, *, owner: Owner, is_final: bool, now: datetime) -> Said:
    """The words and next check for the purchase's state, from its facts."""
    payment = facts.payment_state
    if payment in ("paying", "settlement_pending"):
        return _settlement(facts, now)
    if payment == "unpaid":
        return Said(next_check_at=facts.quote_expires_at, next_check=QUOTE_SWEEP)
    if payment == "failed":
        return _failed(facts, is_final=is_final, now=now)
    if payment != "paid":
        return Said()
    if facts.unfinal is not None:
        return _unfinal(facts, facts.unfinal, _paid(facts, now))
    return _paid(facts, now)


def _paid(facts: CaseFacts, now: datetime) -> Said:
    run = facts.fulfillment_state
    if run == "running":
        return _running(facts, now)
    if run in ("not_started", "queued"):
        return Said(next_check_at=facts.updated_at + facts.sweep_grace, next_check=STALLED_SWEEP)
    if run == "succeeded" and facts.result_expires_at and facts.result_expires_at <= now:
        return Said(sentence="Paid and done; the result's retention has ended, so it is no "
                    "longer stored; the receipt stays.")  # fmt: skip
    if run == "unknown" and facts.execution_recheck_at is None:
        return Said(notes=("Nothing retries this work on its own: support inspects the saved "
                           "job (Reconcile execution now) and resolves.",))  # fmt: skip
    if run == "unknown":
        return Said(
            notes=(
                "The saved job is asked again on its own (never started twice); support may "
                "check at once with Reconcile execution now.",
            ),
            next_check_at=facts.execution_recheck_at,
            next_check=EXECUTION_RECHECK,
        )
    return Said()


def _unfinal(facts: CaseFacts, unfinal: UnfinalFact, work: Said) -> Said:
    """Settled, not final. Once the work has ended the settlement's words lead; while the work
    is on its way they are a note. The work's own next check, if it has one, comes first."""
    if unfinal.finalized_block_seen is not None:
        awaited = (
            f"the node's finalized tag to reach it (finalized block "
            f"{unfinal.finalized_block_seen} at the last look)"
        )
    elif unfinal.depth_seen is not None:
        awaited = f"depth {unfinal.depth_seen} of {unfinal.depth_needed} reached"
        if unfinal.policy == "finalized":  # the node reported no finalized block: the depth
            awaited += " (the node reports no finalized block, so the depth decides)"
    elif unfinal.policy == "finalized":
        awaited = "the node's finalized tag to reach it (not looked at since it settled)"
    else:
        awaited = (
            f"depth at least {unfinal.confirmations} of {unfinal.depth_needed} when it "
            "settled (not looked at since)"
        )
    where = f"block {unfinal.block_number}" if unfinal.block_number is not None else "a block"
    looked = f", last looked at {utc_seconds(unfinal.checked_at)}" if unfinal.checked_at else ""
    settled = (
        f"Payment settled in {where} (tx {unfinal.tx_hash}), awaiting finality: {awaited}"
        f"{looked}. Not final until then: a reorg could still undo the transfer; the finality "
        "watch looks again on its own, and would settle the same signed authorization again."
    )
    at, check = (
        (work.next_check_at, work.next_check)
        if work.next_check_at
        else (unfinal.next_check_at, FINALITY_WATCH)
    )
    if facts.fulfillment_state not in _PAID_WORK:  # the work is still on its way: it leads
        return Said(work.sentence, (*work.notes, settled), at, check)
    words = work.sentence or _PAID_WORK[facts.fulfillment_state]
    return Said(f"{settled} {words}", work.notes, at, check)


# The work's words beside a settlement not final yet (the row's sentence is replaced).
_PAID_WORK = {
    "succeeded": "The work is done and its result stored for the buyer.",
    "failed": "The work provably did not run.",
    "unknown": "The work may or may not have run.",
}


def _settlement(facts: CaseFacts, now: datetime) -> Said:
    at = facts.next_check_at
    if at is None and facts.pending_created_at is not None:
        at = facts.pending_created_at + facts.settlement_grace
    sentence, notes = "", []
    if facts.reason_code == "not_on_chain_yet" and (
        facts.pending_broadcast_at or facts.pending_tx_hash
    ):
        # The look-up's reason says the nonce is unused, not whether the node still holds
        # the transaction (pooled) or lost it (dropped): both are said, neither claimed.
        sentence = (
            f"Broadcast (tx {facts.pending_tx_hash or 'not recorded'}), not mined yet: the "
            "chain shows the authorization's nonce unused. While the node holds the "
            "transaction it is looked up again; if the node has dropped it, the same signed "
            "authorization is resubmitted until its window closes. It is never re-signed."
        )
    check, gap = SETTLEMENT_LOOK_UP, facts.relayer_gap
    if gap is not None:
        notes.append(
            f"Our relayer's transaction with nonce {gap.relayer_nonce} (attempt "
            f"{gap.attempt_id}) may never have been mined: this broadcast (relayer nonce "
            f"{gap.ours}) waits behind that gap until the relayer heal fills it, by "
            f"{utc_seconds(gap.heal_by)} at the latest."
        )
        if at is None or gap.heal_by < at:
            at, check = gap.heal_by, RELAYER_HEAL
    return Said(sentence=sentence, notes=tuple(notes), next_check_at=at, next_check=check)


def _running(facts: CaseFacts, now: datetime) -> Said:
    lease, run = facts.lease_expires_at, facts.execution
    if lease is None or run is None:
        return Said(next_check_at=lease, next_check=LEASE_CHECK if lease else "")
    if lease <= now:
        sentence = (
            f"Paid; the worker {run.worker} stopped renewing its lease at {utc_seconds(lease)} "
            "(it died or stalled): the sweep hands the work to another worker, which polls the "
            "saved job ref instead of starting a second job."
        )
        return Said(sentence=sentence, next_check_at=lease, next_check=STALLED_SWEEP)
    if run.failed_tries:
        waiting = run.failed_tries >= run.tries and run.retry_at is not None
        next_at = run.retry_at if waiting and run.retry_at else lease
        sentence = (
            f"Paid; {run.failed_tries} of {run.max_tries} tries ended with the outcome unknown "
            f"(last: {run.last_error or 'no answer'}); "
            + (f"the next try is due at {utc_seconds(next_at)}" if waiting else
               f"try {run.tries} is running (lease until {utc_seconds(lease)})")
            + f". Escalated as unknown once the tries or the deadline "
            f"({utc_seconds(run.give_up_at)}) run out; never reported failed before."
        )  # fmt: skip
        return Said(sentence=sentence, next_check_at=next_at, next_check=NEXT_TRY)
    sentence = (
        f"Paid; the worker {run.worker} holds the work until its lease ends at "
        f"{utc_seconds(lease)}, renewing it while it runs; if it stops, the sweep takes the "
        "work over from the saved job ref."
    )
    return Said(sentence=sentence, next_check_at=lease, next_check=LEASE_CHECK)


def _failed(facts: CaseFacts, *, is_final: bool, now: datetime) -> Said:
    if facts.quote_expires_at <= now:
        quote = (
            "Its quote has expired: to buy, the buyer asks for a new quote and signs a new "
            "authorization (never a re-signed copy of the old one)."
        )
    else:
        quote = (
            "The buyer may pay this quote again with a new authorization until "
            f"{utc_seconds(facts.quote_expires_at)}; after that, a new quote."
        )
    notes = [quote]
    if is_final:
        notes.append("No authorization it received can land any more and its quote is closed: "
                     "the failure is final.")  # fmt: skip
    check = VOID_SWEEP + "; late transfers are watched every 2 min while a window is open"
    return Said(notes=tuple(notes), next_check_at=facts.void_sweep_at, next_check=check)


def refund_risk(facts: CaseFacts) -> str:
    """What a refund proposed or approved now risks, said on the refund forms: only while the
    work's outcome is unknown (docs/runbook.md, "Refunding an unknown outcome")."""
    if facts.fulfillment_state != "unknown":
        return ""
    at = facts.execution_recheck_at
    when = f"next check {utc_seconds(at)}" if at else "checked again on its schedule"
    return (
        f"The paid work's outcome is still unknown ({facts.reason_code}): Tollbooth is awaiting "
        f"the executor's answer ({when}; 'Reconcile execution now' asks at once). Refunding "
        "now risks paying for delivered work: if the job ran or still finishes, its result is "
        "delivered to the buyer and this refund stands, so the seller pays for the work and "
        "gives the price back. If the check finds it failed, the offering's policy refunds it "
        "then (what is refunded now counts against that, never paid twice by Tollbooth). "
        "Refund now only as docs/runbook.md says ('Refunding an unknown outcome'); finance "
        "approves."
    )
