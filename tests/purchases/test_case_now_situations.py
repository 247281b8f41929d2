"""The Now box in the unfinished bad states of the twelve situations support rehearses
(devtools/situations.py), states x situations, as a table.

Each row is one moment of one situation: the facts as the situation leaves them then (what
the jobs read: the attempt's next look-up and broadcast, the execution's lease, tries and
retry, the quote's expiry, the refunds), and what support must read, written from the
situation and the domain (/work/shared/domain.md), never from purchases.case_file's own
table: whose move it is, until when, whether it can still change, the next automatic check
and its time, words that must be said and words that would be wrong. Pure: no database.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import pytest

from devtools.situations import SITUATIONS
from purchases.case_facts import (
    CaseFacts,
    EscalationFact,
    ExecutionFact,
    RefundFact,
    RelayerGapFact,
    UnfinalFact,
)
from purchases.case_file import Finality, purchase_case

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
S, MIN, H = timedelta(seconds=1), timedelta(minutes=1), timedelta(hours=1)
TX = "0x" + "ab" * 32
QUOTE_OPEN = NOW + 10 * MIN
FAILED_AT = NOW - 2 * MIN
WINDOW_CLOSED = NOW - 1 * MIN  # the authorization's validBefore, passed, nonce unused
BROADCAST_AT = NOW - 40 * S
LEASE_LEFT = NOW + 40 * S
FIRST_TRY = NOW - 3 * MIN
GIVE_UP = FIRST_TRY + 2 * H  # EXECUTION_DEADLINE
RETRY_DUE = NOW + 30 * S


def _facts(payment: str, fulfillment: str = "not_started", /, **kw: object) -> CaseFacts:
    """A purchase at a moment of a situation; defaults as the demo's settings make them."""
    base = CaseFacts(
        payment_state=payment,
        fulfillment_state=fulfillment,
        reason_code="",
        rail="x402",
        amount=250_000,
        updated_at=NOW - 5 * MIN,
        quote_expires_at=QUOTE_OPEN,
        failed_final_after=24 * H,
        sweep_grace=60 * S,
        settlement_grace=30 * S,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def _pending(**kw: object) -> CaseFacts:
    """Broadcast while mining is paused; the next look-up is scheduled by its backoff."""
    args: dict[str, object] = dict(
        reason_code="confirmation_timeout", has_pending_attempt=True,
        pending_created_at=BROADCAST_AT, pending_broadcast_at=BROADCAST_AT, pending_tx_hash=TX,
        next_check_at=NOW + 10 * S, settlement_escalates_at=BROADCAST_AT + 6 * H,
        valid_before_at=NOW + 4 * MIN, landable_valid_before_at=NOW + 4 * MIN,
    )  # fmt: skip
    return _facts("settlement_pending", "not_started", **{**args, **kw})


def _running(**kw: object) -> CaseFacts:
    execution = ExecutionFact(worker="celery@web-2", tries=1, max_tries=8, give_up_at=GIVE_UP)
    args: dict[str, object] = dict(rail="prepaid", lease_expires_at=LEASE_LEFT,
                                   execution=execution)  # fmt: skip
    return _facts("paid", "running", **{**args, **kw})


def _failed_unused(quote_expires_at: datetime) -> CaseFacts:
    """The window closed with the nonce unused: failed; the finalize sweep voids it a day
    after the failure (all windows closed by then)."""
    return _facts(
        "failed", reason_code="authorization_expired_unused", updated_at=FAILED_AT,
        quote_expires_at=quote_expires_at, valid_before_at=WINDOW_CLOSED,
        landable_valid_before_at=WINDOW_CLOSED, void_sweep_at=FAILED_AT + 24 * H,
    )  # fmt: skip


SETTLED_AT = NOW - 20 * S  # mined in block 120 with 1 confirmation: paid, work run at once


def _unfinal(**kw: object) -> CaseFacts:
    """Delivered and paid on the local chain (finality depth 3); the finality watch looked
    10 s ago at depth 2 and looks again at the attempt's next check."""
    unfinal = UnfinalFact(
        attempt_id=5, tx_hash=TX, block_number=120, policy="depth", depth_needed=3,
        confirmations=1, settled_at=SETTLED_AT, next_check_at=NOW + 20 * S,
        escalates_at=SETTLED_AT + 6 * H, depth_seen=2, checked_at=NOW - 10 * S,
    )  # fmt: skip
    return _facts(
        "paid", "succeeded", result_expires_at=NOW + 7 * 24 * H, result_delivered_at=NOW - MIN,
        unfinal=replace(unfinal, **kw),  # type: ignore[arg-type]
    )  # fmt: skip


OWED_LATE = RefundFact(7, "owed", "late_settlement", 250_000)
OWED_DUPLICATE = RefundFact(8, "owed", "duplicate_settlement", 250_000)


@dataclass(frozen=True)
class Moment:
    situation: str
    state: str
    facts: CaseFacts
    owner: str
    deadline_at: datetime | None
    finality: Finality
    next_check_at: datetime | None
    says: tuple[str, ...] = ()
    never_says: tuple[str, ...] = ()
    links: tuple[str, ...] = ()
    changes_until: datetime | None = None
    ids: list[str] = field(default_factory=list)
    offers: tuple[str, ...] = ()  # staff actions that must be offered


WRONG_RUNNING = "a worker is running the work"
MOMENTS = [
    # The settlement's look-up is reconciliation's: due by its backoff, escalated 6 h after
    # the broadcast if nobody can resolve it.
    Moment("settlement-pending", "broadcast, not mined yet", _pending(),
           "reconciliation", BROADCAST_AT + 6 * H, Finality.OPEN, NOW + 10 * S,
           says=("Broadcast",)),
    Moment("settlement-pending", "recorded, no look-up scheduled yet",
           _pending(next_check_at=None, pending_broadcast_at=None, pending_tx_hash="",
                    reason_code="", pending_created_at=NOW - 10 * S,
                    settlement_escalates_at=NOW - 10 * S + 6 * H),
           "reconciliation", NOW - 10 * S + 6 * H, Finality.OPEN, NOW + 20 * S),
    # The node lost the broadcast: the chain shows the nonce unused, but it was broadcast.
    # Paid and delivered at 1 confirmation, but the local chain's finality is depth 3: a
    # reorg can still undo it, so it is not final; the finality watch looks again (never a
    # person's move), and support can make that look now.
    Moment("settlement-pending", "delivered, settled at depth 2 of 3", _unfinal(),
           "reconciliation", SETTLED_AT + 6 * H, Finality.OPEN, NOW + 20 * S,
           says=("settled in block 120", "awaiting finality", "depth 2 of 3", TX),
           never_says=("Paid and done: the result is stored",),
           offers=("recheck_settlement",)),
    Moment("settlement-pending", "settled, the watch not looked yet, due already",
           _unfinal(depth_seen=None, checked_at=None, next_check_at=NOW + 30 * S),
           "reconciliation", SETTLED_AT + 6 * H, Finality.OPEN, NOW + 30 * S,
           says=("settled in block 120", "depth at least 1 of 3"),
           offers=("recheck_settlement",)),
    # On Base the node's finalized tag decides (X402_BASE_FINALITY=finalized).
    Moment("settlement-pending", "settled, awaiting the finalized tag",
           _unfinal(policy="finalized", depth_needed=64, depth_seen=None,
                    finalized_block_seen=100),
           "reconciliation", SETTLED_AT + 6 * H, Finality.OPEN, NOW + 20 * S,
           says=("settled in block 120", "finalized tag", "finalized block 100"),
           offers=("recheck_settlement",)),
    # A node that reports no finalized block: the watch falls back to the depth.
    Moment("settlement-pending", "settled, the node reports no finalized tag",
           _unfinal(policy="finalized", depth_needed=64, depth_seen=5),
           "reconciliation", SETTLED_AT + 6 * H, Finality.OPEN, NOW + 20 * S,
           says=("depth 5 of 64 reached", "no finalized block"),
           offers=("recheck_settlement",)),
    # Final: the watch set final_at; nothing is left to look at, the box says final.
    Moment("settlement-pending", "delivered and final",
           _facts("paid", "succeeded", result_expires_at=NOW + 7 * 24 * H,
                  result_delivered_at=NOW - MIN),
           "none", NOW + 7 * 24 * H, Finality.FINAL, None, never_says=("awaiting finality",)),
    Moment("dropped-broadcast", "dropped from the pool, nonce unused",
           _pending(reason_code="not_on_chain_yet"),
           "reconciliation", NOW + 4 * MIN, Finality.OPEN, NOW + 10 * S,
           says=(f"Broadcast (tx {TX})", "resubmitted", "While the node holds the transaction"),
           # The reason does not say the node lost it (issue 33: the timeline said tx_known).
           never_says=("no broadcast of it is known", "no longer knows")),
    # The next buyer's settlement after a dropped broadcast: our relayer's earlier nonce is
    # a gap its transaction waits behind until the heal job fills it.
    Moment("authorization-expired", "next purchase behind the relayer gap",
           _pending(relayer_gap=RelayerGapFact(41, 17, 18, NOW + 4 * MIN),
                    next_check_at=NOW + 5 * MIN),
           "reconciliation", BROADCAST_AT + 6 * H, Finality.OPEN, NOW + 4 * MIN,
           says=("relayer", "nonce 17", "attempt 41", "heal")),
    # Failed for good as far as this authorization goes; the quote may be paid again while
    # open (then a new quote). The finalize sweep is its next check, a day after the failure.
    Moment("authorization-expired", "failed, quote still open", _failed_unused(QUOTE_OPEN),
           "buyer", QUOTE_OPEN, Finality.FINAL_AT_DEADLINE, FAILED_AT + 24 * H,
           says=("pay this quote again with a new authorization",),
           changes_until=QUOTE_OPEN),
    Moment("authorization-expired", "failed, quote expired", _failed_unused(NOW - MIN),
           "none", None, Finality.FINAL, FAILED_AT + 24 * H,
           says=("asks for a new quote", "final")),
    # The refused authorization landed later: finance pays it back; the page links the refund.
    Moment("late-transfer", "refund owed",
           _facts("failed", reason_code="facilitator_rejected:invalid_payload",
                  updated_at=FAILED_AT, valid_before_at=NOW + 3 * MIN,
                  landable_valid_before_at=None, refunds=(OWED_LATE,),
                  void_sweep_at=FAILED_AT + 24 * H),
           "finance", None, Finality.FINAL_AT_DEADLINE, FAILED_AT + 24 * H,
           says=("owed back",), links=("refund:7",), changes_until=QUOTE_OPEN),
    Moment("two-authorizations", "duplicate owed",
           _facts("paid", "succeeded", refunds=(OWED_DUPLICATE,),
                  result_expires_at=NOW + 7 * 24 * H, result_delivered_at=NOW - MIN),
           "finance", None, Finality.FINAL, None,
           says=("owed back",), links=("refund:8",)),
    # The worker was killed: until its lease runs out nobody can tell, and the page says who
    # holds it until when; after, that it stopped renewing and is taken over.
    Moment("worker-killed", "lease running out", _running(),
           "reconciliation", GIVE_UP, Finality.OPEN, LEASE_LEFT,
           says=("celery@web-2", "lease", "takes the work over"),
           never_says=(WRONG_RUNNING,)),
    Moment("worker-killed", "lease ran out", _running(lease_expires_at=NOW - 5 * S),
           "reconciliation", GIVE_UP, Finality.OPEN, NOW - 5 * S,
           says=("stopped renewing its lease",), never_says=(WRONG_RUNNING,)),
    # The job service is down: five tries ended unknown, the next is due after the backoff.
    Moment("job-service-down", "after 5 failed tries",
           _running(lease_expires_at=NOW + 90 * S,
                    execution=ExecutionFact("celery@web-2", 5, 8, GIVE_UP, failed_tries=5,
                                            last_error="job_service_unavailable",
                                            retry_at=RETRY_DUE)),
           "reconciliation", GIVE_UP, Finality.OPEN, RETRY_DUE,
           says=("5 of 8 tries ended with the outcome unknown", "job_service_unavailable"),
           never_says=(WRONG_RUNNING, "failed.")),
    Moment("job-service-down", "tries spent: unknown, escalated",
           _facts("paid", "unknown", rail="prepaid", reason_code="execution_tries_exhausted",
                  escalations=(EscalationFact(3, "support", "execution_outcome_unknown",
                                              NOW + 4 * H),),
                  execution_recheck_at=NOW + 60 * S),
           "support", NOW + 4 * H, Finality.OPEN, NOW + 60 * S,
           says=("may or may not have run", "asked again on its own")),
    # Queued after payment, its task lost: the stalled-work sweep re-stages it.
    Moment("dropped-connection", "paid, work queued", _facts("paid", "queued", rail="prepaid"),
           "reconciliation", NOW - 5 * MIN + 60 * S, Finality.OPEN, NOW - 5 * MIN + 60 * S),
    Moment("execution-failed", "refunded by policy",
           _facts("paid", "failed", rail="prepaid", reason_code="invalid_report_input",
                  refunds=(RefundFact(2, "paid", "execution_failed", 250_000),)),
           "none", None, Finality.FINAL, None, says=("refunded in full",)),
    Moment("payment-id-conflict", "done, result kept",
           _facts("paid", "succeeded", rail="prepaid", result_expires_at=NOW + 7 * 24 * H),
           "buyer", NOW + 7 * 24 * H, Finality.FINAL, None, says=("stored",)),
    Moment("result-expired", "past retention",
           _facts("paid", "succeeded", rail="prepaid", result_expires_at=NOW - S,
                  result_delivered_at=NOW - 8 * 24 * H),
           "none", None, Finality.FINAL, None,
           says=("no longer stored", "only the receipt remains"),
           never_says=("the result is stored",)),
]  # fmt: skip
# No purchase is kept for a refused prepaid payment: its case is the payment id's record.
NOT_A_PURCHASE = {"balance-too-small"}


def test_the_moments_cover_every_situation() -> None:
    assert {m.situation for m in MOMENTS} | NOT_A_PURCHASE == set(SITUATIONS)


def _said(case: object) -> str:
    return " ".join([case.sentence, *case.notes])  # type: ignore[attr-defined]


@pytest.mark.parametrize("moment", MOMENTS, ids=lambda m: f"{m.situation}: {m.state}")
def test_the_now_box_says_what_the_situation_is(moment: Moment) -> None:
    case = purchase_case(moment.facts, now=NOW)
    said = _said(case)
    assert (case.owner.value, case.deadline_at, case.finality) == (
        moment.owner,
        moment.deadline_at,
        moment.finality,
    ), said
    assert case.next_check_at == moment.next_check_at, said
    for words in moment.says:
        assert words in said, (words, said)
    for words in moment.never_says:
        assert words not in said, (words, said)
    assert case.links == moment.links
    assert set(moment.offers) <= {a.value for a in case.actions}, case.actions
    if moment.changes_until is not None:
        assert case.changes_until == moment.changes_until


@pytest.mark.parametrize("moment", MOMENTS, ids=lambda m: f"{m.situation}: {m.state}")
def test_every_unfinished_state_names_owner_deadline_and_next_check(moment: Moment) -> None:
    """Not final: someone's move (an owed refund is finance's, open until paid back, with no
    deadline), until when, and the next automatic check with what it is; or, where only a
    person can move it, the page says nothing will."""
    case = purchase_case(moment.facts, now=NOW)
    if case.is_final:
        pytest.skip("final: no owner, deadline or next check is owed")
    assert case.owner.value != "none"
    assert case.deadline_at is not None or case.owner.value == "finance"
    if case.next_check_at is not None:
        assert case.next_check
    else:
        assert "Nothing retries" in _said(case), _said(case)
