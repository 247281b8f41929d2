"""`manage.py receipt_verify RECEIPT --address 0x...`: check a signed receipt offline, with
nothing but the receipt and the seller's public address (no database, no network).

RECEIPT is a file, or `-` for standard input, holding the receipt as the Tollbooth-Receipt
header's base64, its JSON text, or a public receipt document (`signed` member). Addresses
come from `--address` (repeatable) or `--keys`, a saved copy of
/.well-known/tollbooth-receipts (every key listed there, current and retired).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from fulfillment.management.published_key_options import (
    published_key_addresses,
    published_key_arguments,
)
from fulfillment.receipt_signing import ReceiptInvalid, receipt_decode, receipt_verify


class Command(BaseCommand):
    help = "Verify a signed receipt offline against the seller's published address."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("receipt", help="A file holding the receipt, or - for stdin.")
        published_key_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        addresses = published_key_addresses(options, own_keys_by_default=False)
        source = options["receipt"]
        raw = sys.stdin.read() if source == "-" else Path(source).read_text()
        try:
            document = receipt_decode(raw)
            document = document.get("signed") or document  # a public receipt document
            signer = receipt_verify(document, addresses=addresses)
        except ReceiptInvalid as invalid:
            raise CommandError(f"invalid receipt: {invalid.reason}") from invalid
        for name, value in document["payload"].items():
            self.stdout.write(f"{name:>13}: {value}")
        self.stdout.write(f"valid: signed by {signer} (key {document.get('keyId', '?')})")
