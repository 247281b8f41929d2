"""`manage.py offerings export|apply|import-openapi`: the catalog as a file
(docs/offerings-as-code.md). Thin: each subcommand is one call into
backoffice.catalog."""

from __future__ import annotations

import getpass
import sys
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from backoffice.catalog.apply import catalog_apply
from backoffice.catalog.checks import catalog_parse
from backoffice.catalog.document import CatalogInvalid
from backoffice.catalog.export import catalog_export
from backoffice.catalog.openapi import catalog_draft_from_openapi
from core.actors import Actor


def _login() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name in this container
        return "unknown"


class Command(BaseCommand):
    help = "Export the catalog to a file, apply a file to the catalog, or draft one from OpenAPI."

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True)
        export = actions.add_parser("export", help="Write the whole catalog (stdout without FILE).")
        export.add_argument("file", nargs="?", help="Where to write it; '-' or none: stdout.")
        apply = actions.add_parser("apply", help="Make the catalog equal to FILE.")
        apply.add_argument("file", help="The catalog file (YAML).")
        apply.add_argument("--dry-run", action="store_true", help="Print the diff, write nothing.")
        apply.add_argument(
            "--check",
            action="store_true",
            help="As --dry-run, and exit 1 when the catalog differs from FILE (for CI).",
        )
        apply.add_argument(
            "--prune", action="store_true", help="Deactivate active offerings the file omits."
        )
        apply.add_argument(
            "--by", default="", help="Who applies it (the events name them); default: your login."
        )
        draft = actions.add_parser(
            "import-openapi",
            help="Draft a catalog file from an OpenAPI 3 document (never applied).",
        )
        draft.add_argument("spec", help="The OpenAPI 3 document (YAML or JSON).")
        draft.add_argument("--base-url", required=True, help="Where the API is served.")
        draft.add_argument("--output", "-o", default="-", help="Where to write the draft.")
        draft.add_argument("--network", default="eip155:8453", help="CAIP-2 network (Base).")
        draft.add_argument(
            "--asset",
            default="0x833589fCD6eDb6E08f4c7C32D4f71b54bdA02913",
            help="The network's token (Base USDC).",
        )
        draft.add_argument("--price", default="0.01 USDC", help="Placeholder price of each.")
        draft.add_argument(
            "--secret-env",
            default="TOLLBOOTH_UPSTREAM_SECRET",
            help="NAME of the variable holding the upstream's signing secret.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        action = options["action"]
        try:
            if action == "export":
                self._write(options.get("file") or "-", catalog_export())
            elif action == "apply":
                self._apply(options)
            else:
                self._draft(options)
        except CatalogInvalid as exc:
            raise CommandError(
                f"{exc.code}: {exc.detail}:\n" + "\n".join(f"  {p}" for p in exc.problems)
            ) from exc

    def _write(self, target: str, text: str) -> None:
        if target == "-":
            self.stdout.write(text, ending="")
            return
        Path(target).write_text(text)
        self.stderr.write(f"wrote {target}")

    def _read(self, source: str) -> str:
        if source == "-":
            return sys.stdin.read()
        try:
            return Path(source).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"cannot read {source}: {exc}") from exc

    def _apply(self, options: dict[str, Any]) -> None:
        path = options["file"]
        catalog = catalog_parse(self._read(path), name=Path(path).name)
        actor = Actor.staff(options["by"] or _login())
        dry_run = options["dry_run"] or options["check"]
        done = catalog_apply(catalog=catalog, actor=actor, dry_run=dry_run, prune=options["prune"])
        self.stdout.write(f"{catalog.name} sha256 {catalog.sha256}, applied by {actor.name}")
        for line in done.lines:
            self.stdout.write(line)
        summary = (
            f"{len(done.created)} created, {len(done.changed)} changed, "
            f"{len(done.deactivated)} deactivated, {len(done.unchanged)} unchanged"
        )
        if not done.changes:
            summary = "nothing to change: " + summary
        if done.dry_run:
            summary += " (dry run: nothing was written)"
        self.stdout.write(summary)
        if options["check"] and done.changes:
            raise CommandError(f"the catalog differs from {catalog.name}: apply it")

    def _draft(self, options: dict[str, Any]) -> None:
        text = catalog_draft_from_openapi(
            self._read(options["spec"]),
            base_url=options["base_url"],
            name=Path(options["spec"]).name,
            network=options["network"],
            asset=options["asset"],
            price=options["price"],
            secret_env=options["secret_env"],
        )
        self._write(options["output"], text)
