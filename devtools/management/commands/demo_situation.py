"""Play one of the twelve failure situations (devtools/situations.py) on the running demo.

    manage.py demo_situation --list
    manage.py demo_situation settlement-pending
    manage.py demo_situation --all

Reads the demo's chain, credentials and process control from TOLLBOOTH_VAR_DIR (as
`make demo` wrote them) and prints each purchase ref with the admin URL to open.
"""

from __future__ import annotations

import json
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.test.utils import override_settings

from devtools import supervisor
from devtools.anvil import AnvilRpc
from devtools.situations import NETWORK, SITUATIONS, SituationFailed, Stage


class DemoProcesses:
    """The demo's processes, through its supervisor's control directory."""

    def __init__(self, var_dir: Path, job_service_url: str) -> None:
        self.var_dir = var_dir
        self.job_service_url = job_service_url

    def kill_worker(self) -> None:
        killed = supervisor.kill(self.var_dir, "worker")
        _wait_new_pid(self.var_dir, "worker", killed)

    def stop_job_service(self) -> None:
        supervisor.request_stop(self.var_dir, "jobservice")
        supervisor.wait_for(self.var_dir, "jobservice", "down")

    def start_job_service(self) -> None:
        supervisor.request_start(self.var_dir, "jobservice")
        supervisor.wait_for(self.var_dir, "jobservice", "running")
        _wait_healthy(f"{self.job_service_url}/health")


def _wait_new_pid(var_dir: Path, name: str, old_pid: int) -> None:
    for _ in range(3):
        entry = supervisor.wait_for(var_dir, name, "running", timeout=60)
        if entry["pid"] != old_pid:
            return
        supervisor.wait_for(var_dir, name, "restarting", timeout=5)
    raise CommandError(f"{name} did not come back (is DEMO_RESTART=never? `demo.py start {name}`)")


def _wait_healthy(url: str, attempts: int = 100) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for _ in range(attempts):
        try:
            with opener.open(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise CommandError(f"{url} did not answer")


class Command(BaseCommand):
    help = "Produce one of the twelve failure situations on the running demo (or --all)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("situation", nargs="?", choices=sorted(SITUATIONS))
        parser.add_argument("--all", action="store_true", help="Play all twelve, in order.")
        parser.add_argument("--list", action="store_true", help="Name them and stop.")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["list"]:
            for name, play in SITUATIONS.items():
                self.stdout.write(_listed(name, play.__doc__ or ""))
            return
        names = list(SITUATIONS) if options["all"] else [options["situation"]]
        if names == [None]:
            raise CommandError("name a situation (see --list) or pass --all")
        chain, credentials = _demo_files(Path(settings.VAR_DIR))
        local = {
            **settings.X402_NETWORKS[NETWORK],
            "rpc_url": chain["rpc_url"],
            "token_address": chain["token"],
            "relayer_private_key": chain["relayer_key"],
        }
        stage = Stage(
            base_url=chain["base_url"],
            chain=AnvilRpc(chain["rpc_url"], chain["chain_id"]),
            token=chain["token"],
            agent_api_key=credentials["demo-agent-alice"],
            wallet_keys=[buyer["private_key"] for buyer in chain["buyers"]],
            processes=DemoProcesses(Path(settings.VAR_DIR), chain["job_service_url"]),
        )
        # This process settles nothing itself but must read the demo's chain as the demo does.
        with override_settings(X402_NETWORKS={**settings.X402_NETWORKS, NETWORK: local}):
            for name in names:
                self.stdout.write(f"{name}: playing ...")
                try:
                    played = SITUATIONS[name](stage)
                except SituationFailed as failure:
                    raise CommandError(f"{name}: {failure}") from failure
                self.stdout.write(self.style.SUCCESS(f"  purchase {played.purchase_ref or '-'}"))
                self.stdout.write(f"  open     {played.admin_url}")
                for note in played.notes:
                    self.stdout.write(f"  what     {note}")


# Name column, then the description wrapped under itself (whole sentences, never cut).
_NAME_WIDTH = 24
_LIST_WIDTH = 100


def _listed(name: str, doc: str) -> str:
    """A situation's line in --list: its name and the docstring's first paragraph, whole."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    return textwrap.fill(
        paragraph,
        width=_LIST_WIDTH,
        initial_indent=f"{name:<{_NAME_WIDTH}} ",
        subsequent_indent=" " * (_NAME_WIDTH + 1),
        break_on_hyphens=False,
    )


def _demo_files(var_dir: Path) -> tuple[dict[str, Any], dict[str, str]]:
    chain_file, credentials_file = var_dir / "demo-chain.json", var_dir / "demo-credentials.json"
    if not chain_file.exists() or not credentials_file.exists():
        raise CommandError(f"no running demo found in {var_dir}: start `make demo` first")
    chain: dict[str, Any] = json.loads(chain_file.read_text())
    if "base_url" not in chain:
        raise CommandError("the demo was started by an older demo.py: restart `make demo`")
    credentials: dict[str, str] = json.loads(credentials_file.read_text())
    return chain, credentials
