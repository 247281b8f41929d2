"""Shared fixtures. Tests whose services are missing (PostgreSQL, Redis, PgBouncer) skip
locally and fail loudly in CI."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from rest_framework.test import APIClient

from core import rate_limit
from purchases.models import Buyer, Offering
from purchases.services.checkout import leases
from purchases.services.shared import outbox
from purchases.services.shared.buyers import api_key_issue
from tests.factories import BuyerFactory, OfferingFactory, fund
from webhooks import events as webhook_events

pytest_plugins = [
    "tests.fixtures.anvil",
    "tests.fixtures.broker",
    "tests.fixtures.demo",
    "tests.fixtures.jobservice",
    "tests.fixtures.outages",
    "tests.fixtures.replicas",
    "tests.fixtures.sample_upstream",
    "tests.fixtures.server",
    "tests.fixtures.webhook",
    "tests.fixtures.worker",
    "tests.x402.e2e",
]

CSV_INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\nsouth,5\n"}


def _uses_postgres() -> bool:
    return settings.DATABASES["default"]["ENGINE"].endswith("postgresql")


def _uses_sqlite_in_memory() -> bool:
    db = settings.DATABASES["default"]
    return db["ENGINE"].endswith("sqlite3") and db.get("TEST", {}).get("NAME") == ":memory:"


# Last, so `-m` has already deselected what this invocation does not run.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _uses_sqlite_in_memory():
        # Threads on a shared-cache memory database fail with table locks no busy timeout
        # waits for; these races run in `make test`'s pass on a file SQLite database.
        for item in items:
            if item.get_closest_marker("sqlite_concurrency"):
                item.add_marker(pytest.mark.skip(reason="runs on a file SQLite database"))
    elif not _uses_postgres():
        _leave_to_the_first_pass(config, items)
    missing = _missing_services(items)
    if not missing:
        return
    if os.environ.get("CI"):
        problems = "; ".join(sorted({p for reasons in missing.values() for p in reasons}))
        raise pytest.UsageError(f"CI must run every test on the real services: {problems}")
    for item, reasons in missing.items():
        item.add_marker(pytest.mark.skip(reason="; ".join(reasons)))


def _needs_postgres(item: pytest.Item) -> bool:
    return bool(item.get_closest_marker("postgres") or item.get_closest_marker("worker"))


def _leave_to_the_first_pass(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`make test`'s pass on a file SQLite database: a PostgreSQL-only test in a module that
    also runs on the embedded default was run (or listed as skipped) by the first pass."""
    elsewhere = [i for i in items if i.get_closest_marker("embedded") and _needs_postgres(i)]
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = [i for i in items if i not in elsewhere]


def _missing_services(items: list[pytest.Item]) -> dict[pytest.Item, list[str]]:
    """Each test that cannot run here, with what it alone lacks (a PostgreSQL-only test is
    not told to set REDIS_URL)."""
    from tests.fixtures.outages import PGBOUNCER, pgbouncer_installed  # a plugin: import late

    missing: dict[pytest.Item, list[str]] = {}
    for item in items:
        if _needs_postgres(item) and not _uses_postgres():
            missing.setdefault(item, []).append("DATABASE_URL does not point at PostgreSQL")
        needs_redis = item.get_closest_marker("worker") or item.get_closest_marker("redis")
        if needs_redis and not settings.REDIS_URL:
            missing.setdefault(item, []).append("REDIS_URL is not set")
        if "pgbouncer" in getattr(item, "fixturenames", ()) and not pgbouncer_installed():
            missing.setdefault(item, []).append(f"{PGBOUNCER} is missing: `make test` installs it")
    return missing


@pytest.fixture(autouse=True)
def _no_outage_carried_over(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A dependency one test took away is not taken away for the next: the throttle's Redis
    outage and the outbox's paused immediate sends are process state (issue 18). Nor are
    the payment-id leases a test claimed and never finished: the heartbeat would renew
    them into the next test's database (and, after the last, a dropped one)."""
    monkeypatch.setattr(rate_limit, "_outage", rate_limit._Outage())
    monkeypatch.setattr(outbox, "_immediate_paused_until", 0.0)
    # Each test starts as a running process does: the webhook subscriptions already read
    # (none), as they are once per 10 s, not on every request (webhooks.events); saving an
    # endpoint makes this process read them again. Never on a timer here: a counted block
    # late in a long test would count the re-read.
    webhook_events.subscriptions_set(frozenset())
    monkeypatch.setattr(webhook_events, "SUBSCRIPTIONS_TTL", float("inf"))
    yield
    with leases._process.lock:
        leases._process.held.clear()
        leases._process.pending.clear()


@pytest.fixture
def offering(db: Any) -> Offering:
    return OfferingFactory.create()


@pytest.fixture
def buyer(db: Any) -> Buyer:
    buyer = BuyerFactory.create()
    fund(buyer, 10_000_000)
    return buyer


@pytest.fixture
def make_client() -> Callable[[Buyer], APIClient]:
    def make(buyer: Buyer) -> APIClient:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_issue(buyer=buyer)}")
        return client

    return make


@pytest.fixture
def client_for_buyer(buyer: Buyer, make_client: Callable[[Buyer], APIClient]) -> APIClient:
    return make_client(buyer)


@pytest.fixture
def db_is_postgres() -> bool:
    return connection.vendor == "postgresql"
