"""The browser rig: Debian's chromium driven by Playwright, the app on a live server on
PostgreSQL, a real Celery worker and job service, and the session's pausable anvil.

One browser, one worker and one job service per session (each test gets a fresh browser
context, a fresh token on the reverted chain and a flushed database), so the twelve
situations cost seconds each, not a process start each. The layout cases need no chain nor
worker: they share the session's browser and their own rows (tests/browser/test_layout.py).
Playwright never downloads a browser here: `make test` installs Debian's `chromium` when it
is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.test import Client
from eth_account.signers.local import LocalAccount

from devtools.anvil import AnvilNode
from devtools.demo_seed import demo_seed
from devtools.situations import NETWORK, Stage
from tests.fixtures.anvil import deploy_funded_usdc, new_accounts
from tests.fixtures.jobservice import JobServiceProcess, start_job_service
from tests.fixtures.worker import WorkerProcess, _database_url, _wait_ready

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ROOT = Path(__file__).resolve().parents[2]
# A run saves its pages in var/screenshots (gitignored), so testing leaves the tree clean; the
# runbook's pictures in docs/screenshots are rewritten only when asked for.
SCREENSHOTS = ROOT / "var" / "screenshots"
DOCS_SCREENSHOTS = ROOT / "docs" / "screenshots"
REFRESH_SCREENSHOTS_ENV = "TOLLBOOTH_REFRESH_SCREENSHOTS"
VIEWPORT = {"width": 1366, "height": 900}  # the support laptop the issue names

# Playwright's sync API keeps an event loop in this thread; the ORM calls the tests make
# between page actions are still plain synchronous calls.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if not Path(str(item.fspath)).is_relative_to(here) or "browser" not in fixtures:
            continue
        item.add_marker(pytest.mark.browser)
        if "browser_world" in fixtures:
            # A real worker and Redis: skipped (or refused in CI) like the other worker tests.
            item.add_marker(pytest.mark.worker)
        else:
            item.add_marker(pytest.mark.postgres)  # the live server reads committed rows
        if not os.access(CHROMIUM, os.X_OK):
            if os.environ.get("CI"):
                raise pytest.UsageError(f"{CHROMIUM} is missing: `make test` installs it")
            item.add_marker(pytest.mark.skip(reason=f"{CHROMIUM} not installed"))


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


# --- processes, one per session ----------------------------------------------------------
class SessionProcesses:
    """The worker and job service the situations take down; brought back like the demo's
    supervisor would, so the next test finds them running."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.job_service: JobServiceProcess = start_job_service(db_path=tmp / "jobs.sqlite3")
        self.job_service_url = self.job_service.url
        self.port = int(self.job_service_url.rsplit(":", 1)[1])
        self.workers: list[WorkerProcess] = []
        self.worker = self._start_worker()

    def _start_worker(self) -> WorkerProcess:
        name = f"browser{len(self.workers)}"
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "config.settings.test",
            "DATABASE_URL": _database_url(),
            "REDIS_URL": django_settings.REDIS_URL,
            "TOLLBOOTH_CELERY_QUEUE": django_settings.CELERY_TASK_DEFAULT_QUEUE,
            "TOLLBOOTH_VAR_DIR": str(self.tmp / f"var-{name}"),
            "JOB_SERVICE_URL": self.job_service_url,
            "TOLLBOOTH_EXECUTION_RETRY_BACKOFF_SECONDS": "0.3",
        }
        log_path = self.tmp / f"worker-{name}.log"
        args = [sys.executable, "-m", "celery", "-A", "config", "worker", "--pool", "solo",
                "--hostname", f"{name}@browser", "--loglevel", "INFO", "--without-gossip",
                "--without-mingle", "-Q", django_settings.CELERY_TASK_DEFAULT_QUEUE]  # fmt: skip
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        worker = WorkerProcess(name, process, log_path)
        self.workers.append(worker)
        _wait_ready(worker)
        return worker

    # StageProcesses
    def kill_worker(self) -> None:
        self.worker.kill()
        self.worker = self._start_worker()

    def stop_job_service(self) -> None:
        self.job_service.stop()

    def start_job_service(self) -> None:
        if self.job_service.process.poll() is None:
            return
        db = self.tmp / "jobs.sqlite3"
        self.job_service = start_job_service(db_path=db, port=self.port)

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.job_service.stop()


# Package scope, not session: the worker listens on the suite's queue, so it must be gone
# before any other test's own worker starts (it would take their jobs).
@pytest.fixture(scope="package")
def session_processes(
    django_db_setup: None, django_db_blocker: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SessionProcesses]:
    with django_db_blocker.unblock():
        processes = SessionProcesses(tmp_path_factory.mktemp("browser-processes"))
    yield processes
    processes.close()


# --- the world of one test -----------------------------------------------------------------
@dataclass
class BrowserWorld:
    stage: Stage
    node: AnvilNode
    seller: LocalAccount
    passwords: dict[str, str]


@contextmanager
def app_served() -> Iterator[str]:
    """The app with its static files (the admin's CSS), as `runserver` would serve it."""
    from django.contrib.staticfiles.handlers import StaticFilesHandler
    from django.core.handlers.wsgi import WSGIHandler
    from django.core.servers.basehttp import ThreadedWSGIServer
    from django.test.testcases import QuietWSGIRequestHandler

    server = ThreadedWSGIServer(("127.0.0.1", 0), QuietWSGIRequestHandler, allow_reuse_address=True)
    server.set_app(StaticFilesHandler(WSGIHandler()))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def live_server_url(transactional_db: None) -> Iterator[str]:
    with app_served() as url:
        yield url


@pytest.fixture
def browser_world(
    live_server_url: str,
    paused_anvil: AnvilNode,
    session_processes: SessionProcesses,
    settings: Any,
    tmp_path: Path,
) -> BrowserWorld:
    """The demo's world on the test's server: its offerings, agents and staff (demo_seed), a
    fresh test USDC with two funded wallets, settlement by a relayer of its own."""
    deployer, relayer, seller, *wallets = new_accounts(paused_anvil, 5)
    token = deploy_funded_usdc(paused_anvil, deployer, [w.address for w in wallets], 100 * 10**6)
    settings.VAR_DIR = tmp_path
    settings.X402_NETWORKS = {
        **settings.X402_NETWORKS,
        NETWORK: {
            **settings.X402_NETWORKS[NETWORK],
            "rpc_url": paused_anvil.rpc_url,
            "token_address": token,
            "relayer_private_key": relayer.key.hex(),
            "confirmation_timeout": 1.0,
        },
    }
    settings.X402_RESULT_WAIT_SECONDS = 0
    job_service = session_processes.job_service_url
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "JOB_SERVICE_URL": job_service}
    seed = demo_seed(asset=token, network=NETWORK, pay_to=seller.address)
    agent = next(a for a in seed["agents"] if a["name"] == "demo-agent-alice")
    stage = Stage(
        base_url=live_server_url,
        chain=paused_anvil,
        token=token,
        agent_api_key=agent["api_key"],
        wallet_keys=["0x" + w.key.hex().removeprefix("0x") for w in wallets],
        processes=session_processes,
        confirmation_timeout=1.0,
    )
    passwords = {s["username"]: s["password"] for s in seed["staff"]}
    return BrowserWorld(stage, paused_anvil, seller, passwords)


def staff_context(browser: Any, base_url: str, username: str, viewport: dict[str, int]) -> Any:
    """A browser context signed in as `username` (a session made by the test client)."""
    client = Client()
    client.force_login(User.objects.get(username=username))
    context = browser.new_context(viewport=viewport, base_url=base_url)
    host = base_url.split("//", 1)[1].split(":")[0]
    context.add_cookies([{"name": django_settings.SESSION_COOKIE_NAME,
                          "value": client.cookies[django_settings.SESSION_COOKIE_NAME].value,
                          "domain": host, "path": "/"}])  # fmt: skip
    return context


@pytest.fixture
def staff_page(browser: Any, browser_world: BrowserWorld) -> Iterator[Callable[[str], Any]]:
    """A logged-in browser page for "support" or "finance" (a fresh context each)."""
    contexts: list[Any] = []

    def page_for(username: str) -> Any:
        context = staff_context(browser, browser_world.stage.base_url, username, VIEWPORT)
        contexts.append(context)
        return context.new_page()

    yield page_for
    for context in contexts:
        context.close()


def screenshots_dir() -> Path:
    """var/screenshots, or docs/screenshots with TOLLBOOTH_REFRESH_SCREENSHOTS=1."""
    return DOCS_SCREENSHOTS if os.environ.get(REFRESH_SCREENSHOTS_ENV) == "1" else SCREENSHOTS


def screenshot(page: Any, name: str) -> Path:
    directory = screenshots_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
