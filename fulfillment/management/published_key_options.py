"""The `--address` / `--keys` options both offline verifiers take (receipt_verify,
evidence_verify): the seller's published receipt keys, given by hand or as a saved copy of
/.well-known/tollbooth-receipts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser

from fulfillment.receipt_signing import published_keys


def published_key_arguments(parser: CommandParser) -> None:
    parser.add_argument(
        "--address", action="append", default=[], help="A published receipt key address."
    )
    parser.add_argument(
        "--keys", help="A saved /.well-known/tollbooth-receipts document (its keys)."
    )


def published_key_addresses(options: dict[str, Any], *, own_keys_by_default: bool) -> list[str]:
    """The addresses to verify against. Without --address or --keys: this deployment's own
    keys when `own_keys_by_default` (and configured), else a CommandError naming the options."""
    addresses = list(options["address"])
    if options["keys"]:
        addresses += _addresses_in(Path(options["keys"]))
    if addresses:
        return addresses
    if own_keys_by_default:
        try:
            return [key.address for key in published_keys()]
        except ImproperlyConfigured:
            pass
    raise CommandError("give the seller's keys: --address 0x... or --keys FILE")


def _addresses_in(path: Path) -> list[str]:
    try:
        published = json.loads(path.read_text())
        return [str(key["address"]) for key in published["keys"]]
    except OSError as exc:
        raise CommandError(f"--keys {path}: {exc.strerror}") from exc
    except (ValueError, TypeError, KeyError) as exc:
        raise CommandError(
            f"--keys {path}: not a /.well-known/tollbooth-receipts document "
            '(a JSON object whose "keys" list entries with an "address")'
        ) from exc
