"""Production refuses to serve while an active offering names a local chain (issue 35, part 4):
a database system check, run by `check --deploy --database default`, `migrate` and
`make serve`'s startup; never by a bare `check` (no database named) nor outside production."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection

from tests.factories import OfferingFactory

ROOT = Path(__file__).resolve().parents[2]
BASE_USDC = "0x833589fCD6eDb6E08f4c7C32D4f71b54bdA02913"


@pytest.fixture(autouse=True)
def _no_async_unsafe(monkeypatch):
    # The browser tests set it for their live server; `check --deploy` then reports
    # async.E001, which is not what these tests are about.
    monkeypatch.delenv("DJANGO_ALLOW_ASYNC_UNSAFE", raising=False)


@pytest.fixture
def production_flag(settings):
    settings.X402_REFUSE_LOCAL_NETWORKS = True
    return settings


def _check_database() -> None:
    call_command("check", "--deploy", "--database", "default", "--fail-level", "ERROR")


@pytest.mark.django_db
def test_an_active_local_offering_fails_the_database_check(production_flag):
    OfferingFactory.create(slug="on-anvil", network="eip155:31337")
    OfferingFactory.create(slug="on-base", network="eip155:8453", asset=BASE_USDC)
    with pytest.raises(SystemCheckError) as refused:
        _check_database()
    message = str(refused.value)
    assert "purchases.E001" in message and "on-anvil (eip155:31337)" in message
    assert "on-base" not in message


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("network", "is_active"),
    [("eip155:31337", False), ("eip155:8453", True), ("eip155:84532", True)],
    ids=["local-inactive", "base", "base-sepolia"],
)
def test_inactive_or_real_network_offerings_pass(production_flag, network, is_active):
    OfferingFactory.create(network=network, is_active=is_active)
    _check_database()


@pytest.mark.django_db
def test_the_check_reads_no_catalog_without_a_database_named(production_flag):
    """A bare `check` (as `ready()` and every management command run) makes no query."""
    OfferingFactory.create(network="eip155:31337")
    call_command("check", "--fail-level", "ERROR")


@pytest.mark.django_db
def test_outside_production_a_local_offering_passes(settings):
    settings.X402_REFUSE_LOCAL_NETWORKS = False  # base, local (the demo) and test settings
    OfferingFactory.create(network="eip155:31337")
    _check_database()


@pytest.mark.django_db
def test_migrate_refuses_too(production_flag):
    OfferingFactory.create(slug="on-anvil", network="eip155:31337")
    with pytest.raises(SystemCheckError, match="on-anvil"):
        call_command("migrate", "--noinput", verbosity=0, skip_checks=False)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_make_serve_refuses_to_start_under_production_settings():
    """scripts/serve.py's own startup check, in a fresh interpreter on production settings,
    against this test database: refused with the offering named, then accepted once it is
    inactive."""
    if connection.vendor != "postgresql":
        pytest.skip("production runs on PostgreSQL")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import serve
    finally:
        sys.path.pop(0)
    db = connection.settings_dict
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("DJANGO_")},
        "DJANGO_SETTINGS_MODULE": "config.settings.production",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/12"),
        "DJANGO_SECRET_KEY": "s" * 20 + os.urandom(24).hex(),
        "DJANGO_ALLOWED_HOSTS": "api.tollbooth.example",
        "TOLLBOOTH_METRICS_TOKEN": "metrics-token-for-the-scraper-0001",
        "TOLLBOOTH_RECEIPT_KEY": "0x" + os.urandom(32).hex(),
    }
    offering = OfferingFactory.create(slug="on-anvil", network="eip155:31337")
    error = serve.settings_error(env)
    assert error is not None and "purchases.E001" in error and "on-anvil" in error
    # The benches' named way out (they sell on anvil in production's shape on purpose).
    assert serve.settings_error({**env, "TOLLBOOTH_BENCH_ALLOW_LOCAL_NETWORKS": "True"}) is None

    offering.is_active = False
    offering.save(update_fields=["is_active"])
    assert serve.settings_error(env) is None
