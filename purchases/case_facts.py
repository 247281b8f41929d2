"""What a purchase's case is derived from, read once (purchases.selectors.purchase_case_facts):
plain values, no rules. The case file (purchases.case_file) and its checks
(purchases.case_checks) both read them; neither is imported here, so the three go one way.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta


@dataclass(frozen=True)
class EscalationFact:
    pk: int
    owner: str
    reason_code: str
    deadline_at: datetime


@dataclass(frozen=True)
class RefundFact:
    pk: int
    state: str
    reason_code: str
    amount: int


@dataclass(frozen=True)
class CaseFacts:
    """What the case is derived from, read once (purchases.selectors.purchase_case_facts)."""

    payment_state: str
    fulfillment_state: str
    reason_code: str
    rail: str
    amount: int
    updated_at: datetime
    quote_expires_at: datetime
    failed_final_after: timedelta
    sweep_grace: timedelta
    has_pending_attempt: bool = False
    next_check_at: datetime | None = None
    valid_before_at: datetime | None = None
    # The latest window of an authorization it received that can still land (not spent: a
    # transfer that landed, on time, late or twice, used its nonce).
    landable_valid_before_at: datetime | None = None
    lease_expires_at: datetime | None = None
    result_expires_at: datetime | None = None
    result_delivered_at: datetime | None = None
    escalations: tuple[EscalationFact, ...] = ()  # open ones
    refunds: tuple[RefundFact, ...] = ()
    # What the jobs read to decide their next move (purchases.case_checks says it).
    settlement_grace: timedelta = timedelta(0)
    pending_created_at: datetime | None = None
    pending_broadcast_at: datetime | None = None  # the pending attempt's broadcast, if sent
    pending_tx_hash: str = ""
    settlement_escalates_at: datetime | None = None  # broadcast + RECONCILIATION_DEADLINE
    relayer_gap: RelayerGapFact | None = None
    void_sweep_at: datetime | None = None  # from when the finalize sweep may mark it void
    execution: ExecutionFact | None = None  # the live (running) execution
    # When the execution that ended unknown is asked again
    # (purchases.services.fulfil.execution_recheck).
    execution_recheck_at: datetime | None = None
    # A settled x402 payment not final yet (the finality watch's row); None once final.
    unfinal: UnfinalFact | None = None


@dataclass(frozen=True)
class UnfinalFact:
    """A settled x402 payment the finality watch (purchases.services.settle.finality) still looks
    at: where it was settled, what the last look saw, when the watch looks next."""

    attempt_id: int
    tx_hash: str
    block_number: int | None
    policy: str  # "depth" or "finalized" (X402_<NET>_FINALITY)
    depth_needed: int  # X402_<NET>_FINALITY_DEPTH
    confirmations: int  # the depth it had at least when it settled
    settled_at: datetime
    # The watch's next look: the attempt's next_check_at, or its next run when due already.
    next_check_at: datetime
    escalates_at: datetime  # settled + RECONCILIATION_DEADLINE: escalated if still unknown
    depth_seen: int | None = None  # at the last look (None: not looked at since it settled)
    finalized_block_seen: int | None = None  # the node's finalized block at the last look
    checked_at: datetime | None = None


@dataclass(frozen=True)
class ExecutionFact:
    worker: str
    tries: int  # tries started, counted in the database across workers
    max_tries: int
    give_up_at: datetime  # the first try + EXECUTION_DEADLINE: unknown and escalated after
    # The latest try that ended with the outcome unknown (its timeline event), if any.
    failed_tries: int = 0
    last_error: str = ""
    retry_at: datetime | None = None  # when that retry is due (the lease covers the backoff)


@dataclass(frozen=True)
class RelayerGapFact:
    """An earlier transaction of our relayer that may never have been mined: a later one
    (this purchase's) waits behind its nonce until the relayer heal fills it."""

    attempt_id: int
    relayer_nonce: int
    ours: int  # this purchase's pending attempt's relayer nonce
    heal_by: datetime  # the heal job's next run at the latest
