"""`manage.py relayer_retire_check <network> <address>`: may this relayer address be retired
(its gas taken away, its key forgotten)? Only once every authorization naming it has passed
its deadline (docs/x402.md, "Rotating and retiring a relayer key"). Exits non-zero, listing
what it still signed, until then. Reads the database only."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from payments.selectors import relayer_retirement


class Command(BaseCommand):
    help = "Say whether a relayer address may be retired yet, and what still names it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("network", help="CAIP-2 id, e.g. eip155:8453")
        parser.add_argument("address", help="The relayer address to retire.")

    def handle(self, *args: Any, **options: Any) -> None:
        found = relayer_retirement(
            network=options["network"], address=options["address"], now=timezone.now()
        )
        for attempt in found.blocking:
            deadline = attempt.valid_before_at.isoformat() if attempt.valid_before_at else "?"
            self.stdout.write(
                f"attempt {attempt.pk} ({attempt.state}) tx {attempt.tx_hash or '-'} "
                f"valid before {deadline}"
            )
        if found.is_current:
            raise CommandError(f"{found.address} is the relayer configured now: rotate first")
        if found.blocking:
            until = found.deadline.isoformat() if found.deadline else "they are settled"
            raise CommandError(
                f"{len(found.blocking)} authorization(s) still name {found.address}: keep it "
                f"funded until {until} and none is pending"
            )
        self.stdout.write(f"ok: {found.address} may be retired on {found.network}")
