"""`manage.py case_table [--format json|markdown]`: the case file's table as data, so the
runbook (docs/runbook.md) can be written from it and checked against it."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from purchases.case_file import (
    ERROR_CODES_ABOUT_A_PURCHASE,
    REASON_CODES,
    RESOLUTION_CODES,
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


class Command(BaseCommand):
    help = "Print the purchase case table (state x reason -> sentence, owner, deadline, actions)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--format", choices=("json", "markdown"), default="markdown")

    def handle(self, *args: Any, **options: Any) -> None:
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
