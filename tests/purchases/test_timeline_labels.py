"""Every timeline subject the code can write has a human label, and evidence reads as
key/value with unix seconds as UTC times."""

from __future__ import annotations

import ast
from datetime import UTC, datetime
from pathlib import Path

from backoffice.timeline import EVENT_LABELS, event_label, evidence_items
from core.clock import utc_seconds
from purchases import event_subjects
from purchases.events import PURCHASE_TRANSITION_SUBJECTS

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("purchases", "payments", "fulfillment", "core")


def _module_constants(tree: ast.Module) -> dict[str, str]:
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    constants[target.id] = node.value.value
    return constants


def written_subjects() -> set[str]:
    """Every `subject=` the production code passes: literals and module constants (an
    imported constant is found in the module that defines and uses it), and every
    `subjects.X` of purchases/event_subjects.py the code names."""
    subjects: set[str] = set(PURCHASE_TRANSITION_SUBJECTS.values())
    for app in PRODUCTION:
        for path in (ROOT / app).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            tree = ast.parse(path.read_text())
            constants = _module_constants(tree)
            for node in ast.walk(tree):
                if (  # subjects.X anywhere (a keyword, a branch, a raw SQL parameter)
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "subjects"
                    and node.attr.isupper()
                ):
                    subjects.add(getattr(event_subjects, node.attr))
                if not isinstance(node, ast.keyword) or node.arg != "subject":
                    continue
                if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                    subjects.add(node.value.value)
                elif isinstance(node.value, ast.Name) and node.value.id in constants:
                    subjects.add(constants[node.value.id])

    return subjects


def test_every_subject_the_code_writes_has_a_label() -> None:
    subjects = written_subjects()
    # The scan sees the lower floors, the constants and the transition helper.
    assert {"payment_attempt", "execution_attempt", "refund", "purchase.payment"} <= subjects
    assert {"payment_attempt.resubmitted", "case.settlement_rechecked"} <= subjects
    assert {"payment_id.replayed", "result.delivered", "alert.failed"} <= subjects
    missing = subjects - set(EVENT_LABELS)
    assert not missing, f"add a label to backoffice.timeline.EVENT_LABELS for {sorted(missing)}"


def test_labels_read_as_words_and_refine_by_state_and_reason() -> None:
    assert event_label(subject="payment_attempt", to_state="recorded") == "Payment recorded"
    assert event_label(subject="payment_attempt", to_state="succeeded") == "Payment settled"
    assert (
        event_label(subject="purchase.payment", reason_code="late_settlement", to_state="failed")
        == "Late transfer landed after the purchase failed"
    )
    assert event_label(subject="brand.new") == "brand.new"  # never an error on the page


def test_evidence_converts_unix_seconds_and_flattens() -> None:
    items = dict(
        evidence_items(
            {
                "valid_before": 1_764_558_245,
                "attempt": 12,
                "answer": {"status": "pending", "http_status": 502},
                "used_by": ["0xaa", "0xbb"],
                "tx_hash": None,
            }
        )
    )
    assert items["valid_before"] == "2025-12-01 03:04:05 UTC (1764558245)"
    assert items["attempt"] == "12"  # not a time
    assert items["answer.status"] == "pending" and items["answer.http_status"] == "502"
    assert items["used_by"] == "0xaa, 0xbb"
    assert items["tx_hash"] == ""
    assert utc_seconds(datetime(2026, 12, 1, 3, 4, 5, tzinfo=UTC)) == "2026-12-01 03:04:05 UTC"
    money = evidence_items({"amount": "250000"}, amount=lambda a: f"{a / 10**6:.6f} USDC ({a})")
    assert money == [("amount", "0.250000 USDC (250000)")]
