"""`manage.py upstream_check <offering>`: reach the offering's upstream and say what is wrong
(secret, reachability, latency, auth through a declared dry run). Never a paid effect."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from purchases.models import Offering
from purchases.services.fulfil.upstreams import offering_upstream_check


class Command(BaseCommand):
    help = "Check an offering's upstream without causing a paid effect."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("offering", help="The offering's slug.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            check = offering_upstream_check(slug=options["offering"])
        except Offering.DoesNotExist as exc:
            raise CommandError(f"no offering {options['offering']!r}") from exc
        for what, finding in check.lines:
            self.stdout.write(f"{what:>10}: {finding}")
        if not check.ok:
            raise CommandError("the upstream check found a problem (see above)")
        self.stdout.write("ok")
