"""`manage.py evidence_export REF [--out FILE] [--by NAME]`: a purchase's signed evidence
pack (docs/evidence.md), its export put on the purchase's timeline."""

from __future__ import annotations

import getpass
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from backoffice.evidence_pack import evidence_pack_export
from core.actors import Actor
from core.errors import DomainError


class Command(BaseCommand):
    help = "Export a purchase's signed dispute evidence pack (JSON), recorded on its timeline."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("ref", help="The purchase's reference, pur_...")
        parser.add_argument("--out", "-o", help="Write the pack here (default: stdout).")
        parser.add_argument(
            "--by", help="Who exports, named on the timeline (default: the login name)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        actor = Actor.staff(options["by"] or getpass.getuser())
        try:
            pack = evidence_pack_export(purchase_ref=options["ref"], actor=actor, channel="command")
        except DomainError as exc:
            raise CommandError(f"{exc.code.value}: {options['ref']}") from exc
        if options["out"]:
            Path(options["out"]).write_text(pack.text, encoding="utf-8")
            self.stderr.write(f"{options['out']}: {pack.purchase}, sha256 {pack.sha256}")
        else:
            self.stdout.write(pack.text)
