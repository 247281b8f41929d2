"""Shared fixtures. PostgreSQL-only tests skip on SQLite locally and fail loudly in CI."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from rest_framework.test import APIClient

from purchases.models import Buyer, Offering
from purchases.services.buyers import api_key_issue
from tests.factories import BuyerFactory, OfferingFactory, fund

pytest_plugins = [
    "tests.fixtures.anvil",
    "tests.fixtures.broker",
    "tests.fixtures.jobservice",
    "tests.fixtures.replicas",
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
    needs_pg = [
        i for i in items if i.get_closest_marker("postgres") or i.get_closest_marker("worker")
    ]
    if not _uses_postgres():
        # A PostgreSQL-only test in a module that also runs on the embedded default: the
        # SQLite pass leaves it to the PostgreSQL pass, where it ran.
        elsewhere = [i for i in needs_pg if i.get_closest_marker("embedded")]
        if elsewhere:
            config.hook.pytest_deselected(items=elsewhere)
            items[:] = [i for i in items if i not in elsewhere]
            needs_pg = [i for i in needs_pg if i not in elsewhere]
    needs_redis = [i for i in items if i.get_closest_marker("worker")]
    problems = []
    if needs_pg and not _uses_postgres():
        problems.append("DATABASE_URL does not point at PostgreSQL")
    if needs_redis and not settings.REDIS_URL:
        problems.append("REDIS_URL is not set")
    if not problems:
        return
    reason = "; ".join(problems)
    if os.environ.get("CI"):
        raise pytest.UsageError(f"CI must run every test on the real services: {reason}")
    for item in needs_pg if not _uses_postgres() else needs_redis:
        item.add_marker(pytest.mark.skip(reason=reason))


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
