"""`manage.py case_table [--format json|markdown|runbook]`: the case file's table as data.
`--format runbook` prints the runbook's reason-code section (docs/runbook.md carries it
between two markers; tests/test_docs.py fails when the two differ)."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from purchases.case_file import (
    ACTION_LABELS,
    ANY,
    CASE_TABLE,
    ERROR_CODES_ABOUT_A_PURCHASE,
    REASON_CODES,
    REASON_MOVES,
    RESOLUTION_CODES,
    Deadline,
    Finality,
    case_table_rows,
)

COLUMNS = (
    "payment_state",
    "fulfillment_state",
    "reason_code",
    "sentence",
    "owner",
    "deadline",
    "finality",
    "actions",
)


def case_table_document() -> dict[str, Any]:
    return {
        "rows": case_table_rows(),
        "remedy_reason_codes": REASON_CODES,
        "error_codes_about_a_purchase": {
            code.value: meaning for code, meaning in ERROR_CODES_ABOUT_A_PURCHASE.items()
        },
        "resolution_codes": RESOLUTION_CODES,
    }


FINALITY_WORDS = {
    Finality.OPEN: "Can still change",
    Finality.FINAL_AT_DEADLINE: "Can change until the deadline, final after",
    Finality.FINAL: "Final",
}
DEADLINE_WORDS = {
    Deadline.QUOTE_EXPIRY: "the quote's expiry",
    Deadline.NEXT_CHECK: "the next reconciliation look-up",
    Deadline.AUTHORIZATION_WINDOW: "the authorization's window closing",
    Deadline.FAILED_FINAL: "the failure becoming final (24 h by default, or the last "
    "authorization's window closing if later)",
    Deadline.EXECUTION_CHECK: "the worker's lease or the sweep grace running out",
    Deadline.RESULT_RETENTION: "the stored result's retention ending",
    Deadline.ESCALATION: "the escalation's deadline",
    Deadline.STILL_PAYABLE: "the last moment money for it can still land (its quote's "
    "expiry, or the window of an authorization it received and not yet spent)",
    Deadline.NONE: "none",
}
RUNBOOK_START = "<!-- case-table:start (generated: manage.py case_table --format runbook) -->"
RUNBOOK_END = "<!-- case-table:end -->"


def _code(value: str) -> str:
    return "any" if value == ANY else f"`{value}`"


def runbook_reason_section() -> str:
    """Every reason code a purchase can carry: what support sees, what it means, whose move
    it is and the safe actions, straight from the case file."""
    lines = [
        RUNBOOK_START,
        "",
        "| payment · work · reason | support sees (Now) | what it means | whose move "
        "| safe actions (when the facts allow) |",
        "|---|---|---|---|---|",
    ]
    for row in CASE_TABLE:
        where = " · ".join(_code(v) for v in (row.payment, row.fulfillment, row.reason))
        means = f"{FINALITY_WORDS[row.finality]}. Deadline: {DEADLINE_WORDS[row.deadline]}."
        actions = "; ".join(ACTION_LABELS[a] for a in row.actions) or "none"
        lines.append(f"| {where} | {row.sentence} | {means} | {row.owner.value} | {actions} |")
    lines += [
        "",
        "Codes on a purchase's remedies (refunds, escalations), its timeline, or the answers "
        "its buyer was given:",
        "",
        "| code | what it means | whose move | safe action |",
        "|---|---|---|---|",
    ]
    meanings = {**REASON_CODES, **{c.value: m for c, m in ERROR_CODES_ABOUT_A_PURCHASE.items()}}
    for code, meaning in meanings.items():
        owner, action = REASON_MOVES[code]
        lines.append(f"| `{code}` | {meaning} | {owner.value} | {action} |")
    lines += ["", RUNBOOK_END]
    return "\n".join(lines)


class Command(BaseCommand):
    help = "Print the purchase case table (state x reason -> sentence, owner, deadline, actions)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--format", choices=("json", "markdown", "runbook"), default="markdown")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["format"] == "runbook":
            self.stdout.write(runbook_reason_section())
            return
        document = case_table_document()
        if options["format"] == "json":
            self.stdout.write(json.dumps(document, indent=2))
            return
        self.stdout.write("| " + " | ".join(COLUMNS) + " |")
        self.stdout.write("|" + "---|" * len(COLUMNS))
        for row in document["rows"]:
            self.stdout.write(
                "| "
                + " | ".join(f"`{row[c]}`" if c != "sentence" else row[c] for c in COLUMNS)
                + " |"
            )
        for title, table in (
            ("Remedy reason codes", document["remedy_reason_codes"]),
            ("Error codes answered about a purchase", document["error_codes_about_a_purchase"]),
            ("Resolution codes", document["resolution_codes"]),
        ):
            self.stdout.write(f"\n{title}\n\n| code | meaning |\n|---|---|")
            for code, meaning in table.items():
                self.stdout.write(f"| `{code}` | {meaning} |")
