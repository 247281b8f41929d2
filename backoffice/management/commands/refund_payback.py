"""`manage.py refund_payback <refund id> <tx hash>`: close a chain refund by its payback,
judged on chain exactly as the admin's **Mark paid back** does (docs/finance.md)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from backoffice.admin.payments import payback_status
from core.actors import Actor
from payments.models import Refund
from payments.paybacks import RefundPaybackRefused
from purchases.services.remedy.paybacks import purchase_refund_payback_close


class Command(BaseCommand):
    help = "Close a chain refund by its payback's transaction hash, if the chain proves it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("refund", type=int, help="The refund's id.")
        parser.add_argument("tx_hash", help="The payback's transaction hash (0x + 64 hex).")
        parser.add_argument("--by", required=True, help="Who sent the money (your username).")

    def handle(self, *args: Any, **options: Any) -> None:
        if not Refund.objects.filter(pk=options["refund"], method="pay_back").exists():
            raise CommandError(f"no chain refund {options['refund']}")
        try:
            recorded = purchase_refund_payback_close(
                refund_id=options["refund"],
                tx_hash=options["tx_hash"],
                now=None,
                actor=Actor.staff(options["by"]),
            )
        except RefundPaybackRefused as exc:
            raise CommandError(f"refused: {exc}") from exc
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        refund = recorded.refund
        if recorded.verdict.closes:
            self.stdout.write(f"refund {refund.pk} paid back: {payback_status(refund)}")
        else:
            self.stdout.write(f"refund {refund.pk} still owed, pending: {payback_status(refund)}")
