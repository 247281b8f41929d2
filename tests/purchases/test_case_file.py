"""The case file's "Now": every row of the table, the remedies laid over it, the safe actions,
and that every reason code the code can set (and every error code answered about an
existing purchase) is explained. Pure: no database."""

from __future__ import annotations

import ast
import re
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from core.errors import ErrorCode, Owner
from purchases.case_facts import CaseFacts, EscalationFact, RefundFact
from purchases.case_file import (
    ANY,
    CASE_TABLE,
    ERROR_CODES_ABOUT_A_PURCHASE,
    Action,
    Deadline,
    Finality,
    Row,
    case_reason_codes,
    case_row,
    case_table_rows,
    purchase_case,
    relative,
)

ROOT = Path(__file__).resolve().parents[2]
NOW = datetime(2026, 12, 1, 3, 0, 0, tzinfo=UTC)
# A concrete state for a wildcard, chosen so no more specific row catches it.
SOME_FULFILMENT = {"failed": "not_started", "void": "not_started"}


def _facts(row: Row, **overrides: object) -> CaseFacts:
    fulfillment = row.fulfillment if row.fulfillment != ANY else "not_started"
    if row.reason == ANY:
        reason = "some_reason_nobody_sets"
    elif row.reason.endswith(":*"):
        reason = row.reason[:-1] + "whatever the facilitator said"
    else:
        reason = row.reason
    facts = CaseFacts(
        payment_state=row.payment,
        fulfillment_state=fulfillment,
        reason_code=reason,
        rail="x402",
        amount=250_000,
        updated_at=NOW - timedelta(minutes=5),
        quote_expires_at=NOW + timedelta(minutes=10),
        failed_final_after=timedelta(hours=24),
        sweep_grace=timedelta(seconds=60),
        has_pending_attempt=row.payment in ("paying", "settlement_pending"),
        next_check_at=NOW + timedelta(seconds=30),
        valid_before_at=NOW + timedelta(minutes=4),
        lease_expires_at=NOW + timedelta(seconds=45) if fulfillment == "running" else None,
        result_expires_at=NOW + timedelta(days=7) if fulfillment == "succeeded" else None,
    )
    return replace(facts, **overrides)  # type: ignore[arg-type]


def _expected_deadline(row: Row, facts: CaseFacts) -> datetime | None:
    return {
        Deadline.QUOTE_EXPIRY: facts.quote_expires_at,
        Deadline.NEXT_CHECK: facts.next_check_at,
        Deadline.AUTHORIZATION_WINDOW: facts.valid_before_at,
        # Until when it can change: its quote, open for a new payment (no authorization
        # left to land in the bare row); the finalize sweep's time is its next check.
        Deadline.FAILED_FINAL: facts.quote_expires_at,
        Deadline.EXECUTION_CHECK: facts.lease_expires_at or facts.updated_at + facts.sweep_grace,
        Deadline.RESULT_RETENTION: facts.result_expires_at,
        Deadline.ESCALATION: None,  # no escalation open in the bare row
        Deadline.STILL_PAYABLE: facts.quote_expires_at,  # no authorization left to land
        Deadline.NONE: None,
    }[row.deadline]


@pytest.mark.parametrize("row", CASE_TABLE, ids=lambda r: f"{r.payment}/{r.fulfillment}/{r.reason}")
def test_every_row_gives_its_sentence_owner_deadline_and_finality(row: Row) -> None:
    facts = _facts(row)
    case = purchase_case(facts, now=NOW)
    assert case.row == row
    assert case.sentence == row.sentence
    assert case.owner == row.owner
    deadline_at = _expected_deadline(row, facts)
    assert case.deadline_at == deadline_at
    # A source with nothing to read (no escalation open yet) is shown as no deadline.
    assert case.deadline_source == (row.deadline if deadline_at else Deadline.NONE)
    assert case.finality == row.finality
    # Only actions the row offers, and only those safe now.
    assert set(case.actions) <= set(row.actions)
    assert Action.RESOLVE not in case.actions and Action.APPROVE_REFUND not in case.actions
    if case.finality == Finality.FINAL_AT_DEADLINE:
        assert case.changes_until == case.deadline_at


def test_table_is_exported_as_data_with_every_row() -> None:
    rows = case_table_rows()
    assert len(rows) == len(CASE_TABLE)
    assert {
        tuple(r[k] for k in ("payment_state", "fulfillment_state", "reason_code")) for r in rows
    } == {(r.payment, r.fulfillment, r.reason) for r in CASE_TABLE}
    assert all(r["sentence"] and r["owner"] for r in rows)


def test_every_payment_state_has_a_row() -> None:
    from purchases.models import Purchase

    for state in Purchase.PaymentState.values:
        assert case_row(payment=state, fulfillment="not_started", reason_code="").payment == state


def test_facilitator_codes_fall_on_their_prefix_row() -> None:
    row = case_row(
        payment="failed", fulfillment="not_started", reason_code="facilitator_rejected:x"
    )
    assert row.reason == "facilitator_rejected:*"


# --- overlays: escalations and refunds ----------------------------------------------------
PAID_DONE = case_row(payment="paid", fulfillment="succeeded", reason_code="")
UNKNOWN = case_row(payment="paid", fulfillment="unknown", reason_code="job_status_unknown")


def test_an_open_escalation_names_its_owner_and_deadline() -> None:
    due = NOW + timedelta(hours=2)
    facts = _facts(
        UNKNOWN,
        escalations=(
            EscalationFact(8, "finance", "later_one", NOW + timedelta(hours=5)),
            EscalationFact(7, "support", "execution_outcome_unknown", due),
        ),
    )
    case = purchase_case(facts, now=NOW)
    assert (case.owner, case.deadline_at, case.deadline_source) == (
        Owner.SUPPORT,
        due,
        Deadline.ESCALATION,
    )
    assert Action.RESOLVE in case.actions and Action.RECONCILE_EXECUTION in case.actions
    assert "Escalated to support: execution_outcome_unknown." in case.notes
    assert relative(case.deadline_at, NOW) == "in 2 h 00 min"


def test_a_proposed_refund_is_finances_and_not_owed() -> None:
    facts = _facts(PAID_DONE, refunds=(RefundFact(1, "proposed", "support_refund", 250_000),))
    case = purchase_case(facts, now=NOW)
    assert case.owner == Owner.FINANCE
    assert Action.APPROVE_REFUND in case.actions
    assert Action.PROPOSE_REFUND not in case.actions  # one open proposal at a time
    assert any("not owed until finance approves" in n for n in case.notes)


def test_late_and_duplicate_transfers_show_in_the_header() -> None:
    failed = case_row(payment="failed", fulfillment="not_started", reason_code="")
    late = purchase_case(
        _facts(failed, refunds=(RefundFact(1, "owed", "late_settlement", 250_000),)), now=NOW
    )
    assert late.late_transfer and not late.duplicate_transfer and late.owner == Owner.FINANCE
    assert "landed after it had failed" in late.notes[0]
    duplicate = purchase_case(
        _facts(PAID_DONE, refunds=(RefundFact(2, "owed", "duplicate_settlement", 250_000),)),
        now=NOW,
    )
    assert duplicate.duplicate_transfer and not duplicate.late_transfer


def test_a_late_transfer_on_a_refused_payment_says_money_moved() -> None:
    refused = case_row(
        payment="failed", fulfillment="not_started", reason_code="facilitator_rejected:x"
    )
    assert "can still land until its window closes" in refused.sentence  # not "can never"
    owed = RefundFact(1, "owed", "late_settlement", 250_000)
    facts = _facts(refused, reason_code="facilitator_rejected:invalid_signature", refunds=(owed,))
    case = purchase_case(facts, now=NOW)
    assert case.row.reason == "late_settlement"
    assert "no money moved" not in case.sentence and "landed anyway" in case.sentence
    # Finance owns it with no deadline. The refused authorization landed, so it cannot land
    # again: only a new payment while the quote is open can still change the purchase.
    assert (case.owner, case.deadline_at, case.deadline_source) == (
        Owner.FINANCE,
        None,
        Deadline.NONE,
    )
    assert case.changes_until == facts.quote_expires_at and not case.is_final
    assert case.refund_open
    assert case.actions == (Action.ASSIGN,)
    paid_back = purchase_case(replace(facts, refunds=(replace(owed, state="paid"),)), now=NOW)
    assert paid_back.owner == Owner.BUYER  # it may pay again; nothing is owed any more
    assert "A transfer for it landed after it had failed: it was paid back." in paid_back.notes


def test_a_duplicate_transfer_is_finances_without_the_buyers_deadline() -> None:
    owed = RefundFact(2, "owed", "duplicate_settlement", 250_000)
    case = purchase_case(_facts(PAID_DONE, refunds=(owed,)), now=NOW)
    assert (case.owner, case.deadline_at, case.deadline_source) == (
        Owner.FINANCE,
        None,
        Deadline.NONE,
    )
    assert case.actions == (Action.REDELIVER_RESULT, Action.ASSIGN)  # no second proposal
    # The purchase is settled (final), and the page says its remedy is open too.
    assert case.is_final and case.refund_open
    paid_back = purchase_case(_facts(PAID_DONE, refunds=(replace(owed, state="paid"),)), now=NOW)
    assert paid_back.is_final and not paid_back.refund_open


def test_a_refund_is_open_only_while_owed() -> None:
    for state, is_open in (
        ("proposed", False),
        ("owed", True),
        ("paid", False),
        ("declined", False),
    ):
        refund = RefundFact(1, state, "support_refund", 250_000)
        assert purchase_case(_facts(PAID_DONE, refunds=(refund,)), now=NOW).refund_open is is_open


LATE_OWED = RefundFact(1, "owed", "late_settlement", 250_000)


def _late(**overrides: object) -> CaseFacts:
    """A refused payment whose authorization landed after the quote closed."""
    refused = case_row(
        payment="failed", fulfillment="not_started", reason_code="facilitator_rejected:x"
    )
    facts = _facts(
        refused,
        reason_code="facilitator_rejected:invalid_signature",
        quote_expires_at=NOW - timedelta(minutes=1),
        # The landed authorization's own window may still be open: it is spent all the same.
        valid_before_at=NOW + timedelta(minutes=4),
        landable_valid_before_at=None,
        refunds=(LATE_OWED,),
    )
    return replace(facts, **overrides)  # type: ignore[arg-type]


def test_a_late_transfer_after_the_quote_closed_is_final_with_its_refund_open() -> None:
    case = purchase_case(_late(), now=NOW)
    # Not "can change until" the failure's 24 h: the authorization landed, the quote is
    # closed, nothing can change the failure any more; only the refund is left to pay.
    assert (case.finality, case.changes_until, case.refund_open) == (Finality.FINAL, None, True)
    assert (case.owner, case.deadline_at) == (Owner.FINANCE, None)
    assert case.late_transfer and "landed anyway" in case.sentence
    paid_back = purchase_case(_late(refunds=(replace(LATE_OWED, state="paid"),)), now=NOW)
    assert (paid_back.finality, paid_back.refund_open) == (Finality.FINAL, False)
    # The buyer cannot pay for it any more: nobody has a move.
    assert (paid_back.owner, paid_back.deadline_at, paid_back.deadline_source) == (
        Owner.NONE,
        None,
        Deadline.NONE,
    )


def test_a_late_transfer_can_change_while_money_for_it_can_still_land() -> None:
    open_quote = purchase_case(_late(quote_expires_at=NOW + timedelta(minutes=2)), now=NOW)
    assert open_quote.finality == Finality.FINAL_AT_DEADLINE
    assert open_quote.changes_until == NOW + timedelta(minutes=2)
    assert any("its quote is open for a new payment" in note for note in open_quote.notes)
    other = NOW + timedelta(hours=1)  # a second authorization, not spent, still valid
    another = purchase_case(_late(landable_valid_before_at=other), now=NOW)
    assert (another.finality, another.changes_until) == (Finality.FINAL_AT_DEADLINE, other)
    assert purchase_case(_late(landable_valid_before_at=other), now=other).is_final


def test_failed_work_refunded_in_full_leaves_nobody_a_move() -> None:
    failed = case_row(payment="paid", fulfillment="failed", reason_code="job_failed")
    refunded = (RefundFact(1, "paid", "execution_failed", 250_000),)
    case = purchase_case(_facts(failed, refunds=refunded), now=NOW)
    assert (case.owner, case.deadline_at, case.deadline_source) == (Owner.NONE, None, Deadline.NONE)
    assert case.actions == (Action.ASSIGN,)
    assert "The payment was refunded in full." in case.notes
    partly = (RefundFact(1, "paid", "support_compensation", 100_000),)
    assert purchase_case(_facts(failed, refunds=partly), now=NOW).owner == Owner.SUPPORT


def test_a_result_past_retention_has_no_deadline_left() -> None:
    gone = _facts(PAID_DONE, result_expires_at=NOW - timedelta(seconds=1), result_delivered_at=NOW)
    case = purchase_case(gone, now=NOW)
    assert (case.owner, case.deadline_at, case.deadline_source) == (
        Owner.NONE,
        None,
        Deadline.NONE,
    )
    assert "only the receipt remains" in " ".join(case.notes)
    assert case.actions == (Action.PROPOSE_REFUND, Action.ASSIGN)  # nothing to redeliver
    never_fetched = purchase_case(replace(gone, result_delivered_at=None), now=NOW)
    assert never_fetched.owner == Owner.NONE  # the buyer can no longer fetch it


def test_actions_are_offered_only_when_safe() -> None:
    expired = purchase_case(
        _facts(PAID_DONE, result_expires_at=NOW - timedelta(seconds=1)), now=NOW
    )
    assert Action.REDELIVER_RESULT not in expired.actions
    fresh = purchase_case(_facts(PAID_DONE), now=NOW)
    assert Action.REDELIVER_RESULT in fresh.actions and Action.PROPOSE_REFUND in fresh.actions
    refunded = purchase_case(
        _facts(PAID_DONE, refunds=(RefundFact(1, "paid", "support_refund", 250_000),)), now=NOW
    )
    assert Action.PROPOSE_REFUND not in refunded.actions  # nothing left to return
    declined = purchase_case(
        _facts(PAID_DONE, refunds=(RefundFact(1, "declined", "support_refund", 250_000),)), now=NOW
    )
    assert Action.PROPOSE_REFUND in declined.actions
    pending = case_row(payment="settlement_pending", fulfillment="not_started", reason_code="")
    assert Action.RECHECK_SETTLEMENT in purchase_case(_facts(pending), now=NOW).actions
    prepaid = purchase_case(_facts(pending, rail="prepaid"), now=NOW)
    assert Action.RECHECK_SETTLEMENT not in prepaid.actions
    queued = case_row(payment="paid", fulfillment="queued", reason_code="")
    in_grace = purchase_case(_facts(queued, updated_at=NOW - timedelta(seconds=10)), now=NOW)
    assert Action.RECONCILE_EXECUTION not in in_grace.actions  # the worker still has it
    stalled = purchase_case(_facts(queued, updated_at=NOW - timedelta(minutes=5)), now=NOW)
    assert Action.RECONCILE_EXECUTION in stalled.actions


def test_a_delivered_result_leaves_nobody_a_move() -> None:
    waiting = purchase_case(_facts(PAID_DONE), now=NOW)
    delivered = purchase_case(_facts(PAID_DONE, result_delivered_at=NOW), now=NOW)
    assert (waiting.owner, delivered.owner) == (Owner.BUYER, Owner.NONE)
    assert Action.REDELIVER_RESULT in delivered.actions  # still kept: it can be sent again


def test_failure_is_final_only_after_the_last_window_closes() -> None:
    failed = case_row(payment="failed", fulfillment="not_started", reason_code="")
    late_window = NOW + timedelta(days=2)
    facts = _facts(failed, valid_before_at=late_window, landable_valid_before_at=late_window)
    case = purchase_case(facts, now=NOW)
    assert case.changes_until == late_window and not case.is_final


# --- every reason the code can set is explained -------------------------------------------
def _source(relative_path: str) -> str:
    return (ROOT / relative_path).read_text()


def _settlement_reasons() -> dict[str, set[str]]:
    """Reason codes a settlement look-up or settler can give, by the status they go with."""
    lookup = _source("payments/rails/x402/lookup.py")
    direct = _source("payments/rails/x402/direct.py")
    pending = set(re.findall(r'_outcome\(case, PENDING, "(\w+)"', lookup))
    failed = set(re.findall(r'_outcome\(case, FAILED, "(\w+)"', lookup))
    pending |= {"chain_unavailable", "awaiting_confirmations", "broadcast_not_prepared"}
    pending |= set(re.findall(r'SettlementStatus\.PENDING, tx_hash, "(\w+)"', direct))
    pending |= set(re.findall(r'_pending\(tx_hash, "(\w+)"', direct))
    failed |= set(re.findall(r'SettlementStatus\.FAILED, tx_hash, "(\w+)"', direct))
    facilitator = _source("payments/rails/x402/facilitator.py")
    pending |= set(re.findall(r'^REASON_\w+ = "(\w+)"', facilitator, re.M))
    pending.add("facilitator_unresolved:*")
    failed.add("facilitator_rejected:*")
    return {"settlement_pending": pending, "failed": failed}


def _execution_reasons() -> set[str]:
    found: set[str] = set()
    for path in [
        *ROOT.glob("fulfillment/**/*.py"),
        ROOT / "purchases/services/fulfil/execution.py",
    ]:
        text = path.read_text()
        found |= set(re.findall(r'ExecutorError\(\s*"(\w+)"', text))
        found |= set(re.findall(r'return "(execution_\w+)"', text))
    return found


def test_every_settlement_reason_has_its_own_row() -> None:
    reasons = _settlement_reasons()
    assert "not_on_chain_yet" in reasons["settlement_pending"]  # the scan finds them
    assert "authorization_expired_unused" in reasons["failed"]
    for state, codes in reasons.items():
        for code in codes:
            row = case_row(payment=state, fulfillment="not_started", reason_code=code)
            assert row.reason == code, f"{state} with {code} has no row of its own"


def test_every_execution_reason_has_its_own_row() -> None:
    codes = _execution_reasons()
    assert {"job_failed", "job_service_unavailable", "execution_tries_exhausted"} <= codes
    definitive = {"job_failed", "job_rejected", "invalid_report_input", "executor_not_registered"}
    definitive |= {"not_fetchable", "upstream_rejected"}
    for code in codes:
        state = "failed" if code in definitive else "unknown"
        row = case_row(payment="paid", fulfillment=state, reason_code=code)
        assert row.reason == code, f"execution {state} with {code} has no row of its own"


def _error_codes_naming_a_purchase() -> set[str]:
    """ErrorCodes raised with `purchase=` somewhere in production code."""
    found: set[str] = set()
    for path in [
        *ROOT.glob("purchases/**/*.py"),
        *ROOT.glob("payments/**/*.py"),
        *ROOT.glob("doors/**/*.py"),
    ]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "DomainError"):
                continue
            if any(k.arg == "purchase" for k in node.keywords) and node.args:
                first = node.args[0]
                if isinstance(first, ast.Attribute):
                    found.add(first.attr)
    return found


def test_every_error_code_answered_about_a_purchase_is_explained() -> None:
    raised = _error_codes_naming_a_purchase()
    assert "QUOTE_ALREADY_PAID" in raised  # the scan finds them
    explained = {code.name for code in ERROR_CODES_ABOUT_A_PURCHASE}
    assert raised <= explained, raised - explained
    assert all(isinstance(code, ErrorCode) for code in ERROR_CODES_ABOUT_A_PURCHASE)
    assert {c.value for c in ERROR_CODES_ABOUT_A_PURCHASE} <= case_reason_codes()


def test_case_table_command_exports_the_table_for_the_runbook() -> None:
    import io
    import json

    from django.core.management import call_command

    out = io.StringIO()
    call_command("case_table", "--format", "json", stdout=out)
    document = json.loads(out.getvalue())
    assert len(document["rows"]) == len(CASE_TABLE)
    assert "execution_outcome_unknown" in document["remedy_reason_codes"]
    assert "quote_already_paid" in document["error_codes_about_a_purchase"]
    markdown = io.StringIO()
    call_command("case_table", stdout=markdown)
    assert all(f"`{row.reason}`" in markdown.getvalue() for row in CASE_TABLE)
