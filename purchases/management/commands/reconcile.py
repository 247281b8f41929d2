"""`manage.py reconcile --once`: one pass of every reconciliation job, with progress."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db.models import Q
from django.utils import timezone
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from payments.models import PaymentAttempt
from purchases.services.fulfil.sweeper import purchases_sweep_stalled
from purchases.services.jobs import housekeeping, reconcile
from purchases.services.remedy import paybacks, payout_reconcile
from purchases.services.shared import outbox


class Command(BaseCommand):
    help = "One pass of every reconciliation job (settlements, late money, quotes, ids, alerts)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="Run one pass and exit.")
        parser.add_argument(
            "--every", type=float, default=0.0, help="Without --once: seconds between passes."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not options["once"] and not options["every"]:
            self.stderr.write(
                "Say --once for one pass, or --every SECONDS to keep going (beat does this too)."
            )
            return
        while True:
            self._one_pass()
            if options["once"]:
                return
            time.sleep(options["every"])

    def _one_pass(self) -> None:
        console = Console(file=self.stdout, force_terminal=False)  # type: ignore[arg-type]
        results: list[tuple[str, Counter[str]]] = []
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            now = timezone.now()
            due = (
                PaymentAttempt.objects.filter(
                    rail="x402",
                    state__in=reconcile.PENDING_STATES,
                    broadcast_started_at__isnull=False,
                )
                .filter(Q(next_check_at__isnull=True) | Q(next_check_at__lte=now))
                .count()
            )
            bar = progress.add_task("pending settlements", total=due or 1)
            results.append(
                (
                    "pending_settlements",
                    reconcile.reconcile_pending_settlements(
                        progress=lambda n: progress.advance(bar, n)
                    ),
                )
            )
            progress.update(bar, completed=due or 1)
            jobs: list[tuple[str, Callable[[], Counter[str]]]] = [
                ("late_settlements", reconcile.watch_failed_attempts),
                ("finalize_failed", reconcile.finalize_failed_purchases),
                ("expire_quotes", housekeeping.expire_quotes),
                ("purge_quotes", housekeeping.purge_expired_quotes),
                ("compact_payment_ids", housekeeping.compact_payment_ids),
                ("alerts", housekeeping.send_pending_alerts),
                ("heal_relayers", reconcile.heal_relayers),
                ("refund_paybacks", lambda: Counter(paybacks.refund_paybacks_watch())),
                ("payouts", lambda: Counter(payout_reconcile.payouts_reconcile())),
                ("executions", purchases_sweep_stalled),
                ("outbox_relay", outbox.outbox_relay_due),
                ("prune_outbox", outbox.outbox_prune),
            ]
            step = progress.add_task("other jobs", total=len(jobs))
            for name, job in jobs:
                results.append((name, job()))
                progress.advance(step)
        table = Table(title="Reconciliation pass")
        table.add_column("job")
        table.add_column("outcome")
        for name, stats in results:
            table.add_row(
                name, ", ".join(f"{k}={v}" for k, v in sorted(stats.items())) or "nothing to do"
            )
        console.print(table)
