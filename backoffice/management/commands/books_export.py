"""`manage.py books_export --month 2026-11 [-o FILE]`: a closed period's books as CSV."""

from __future__ import annotations

from datetime import date
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from backoffice.books import Period, PeriodInvalid
from backoffice.books_export import books_export_stream
from payments.models import ExportBatch


class Command(BaseCommand):
    help = (
        "Export a closed period's books (revenue per offering, refunds, credits, gas, net, "
        "prepaid held and consumed) as CSV, recorded as an export batch with its SHA-256."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--month", help="A whole UTC month, YYYY-MM.")
        parser.add_argument("--from", dest="first_day", type=date.fromisoformat,
                            help="First day (UTC), YYYY-MM-DD, with --to.")  # fmt: skip
        parser.add_argument("--to", dest="last_day", type=date.fromisoformat,
                            help="Last day (UTC, included), YYYY-MM-DD.")  # fmt: skip
        parser.add_argument(
            "--include-self-payments",
            action="store_true",
            help="Count payments from the seller's own wallets as revenue.",
        )
        parser.add_argument("-o", "--output", help="Write the file here (default: stdout).")
        parser.add_argument("--by", default="manage.py", help="Who exports (on the batch).")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            if options["month"]:
                period = Period.month(options["month"])
            elif options["first_day"] and options["last_day"]:
                period = Period.days(options["first_day"], options["last_day"])
            else:
                raise PeriodInvalid("give --month YYYY-MM, or --from and --to")
            recorded: list[ExportBatch] = []
            chunks = books_export_stream(
                period=period,
                created_by=options["by"],
                include_self_payments=options["include_self_payments"],
                on_recorded=recorded.append,
            )
        except PeriodInvalid as exc:
            raise CommandError(str(exc)) from exc
        # Written as it is produced: memory stays flat however long the period.
        if options["output"]:
            with Path(options["output"]).open("wb") as out:
                for chunk in chunks:
                    out.write(chunk)
        else:
            for chunk in chunks:
                self.stdout.write(chunk.decode(), ending="")
        (batch,) = recorded
        self.stderr.write(
            f"books {period.slug}: {batch.row_count} rows, sha256 {batch.sha256} "
            f"(export batch {batch.pk})"
        )
