"""`manage.py evidence_verify FILE [--address 0x... | --keys KEYS.json]`: check a dispute
evidence pack offline (no database, no network): its content against its sealed SHA-256,
the seal's signature against the seller's published receipt keys.

Addresses come from `--address` (repeatable) or `--keys`, a saved copy of
/.well-known/tollbooth-receipts; without either, from this deployment's own receipt keys
(current and retired: TOLLBOOTH_RECEIPT_KEY, TOLLBOOTH_RECEIPT_RETIRED_KEYS).
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from fulfillment.evidence_seal import PackInvalid, pack_decode, pack_verify
from fulfillment.management.published_key_options import (
    published_key_addresses,
    published_key_arguments,
)


class Command(BaseCommand):
    help = "Verify a dispute evidence pack offline against the seller's published keys."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="The pack (JSON), or - for stdin.")
        published_key_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        addresses = published_key_addresses(options, own_keys_by_default=True)
        source = options["file"]
        raw = sys.stdin.read() if source == "-" else Path(source).read_bytes()
        try:
            document = pack_decode(raw)
            signer = pack_verify(document, addresses=addresses)
        except PackInvalid as invalid:
            raise CommandError(f"invalid evidence pack: {invalid.reason}") from invalid
        seal = document["seal"]
        issued = datetime.fromtimestamp(seal["issuedAt"], tz=UTC).isoformat()
        self.stdout.write(f"     purchase: {seal['purchase']}")
        self.stdout.write(f"    issued at: {issued}")
        self.stdout.write(f"content sha256: {seal['contentSha256']}")
        self.stdout.write(f"valid: signed by {signer} (key {document.get('keyId', '?')})")
