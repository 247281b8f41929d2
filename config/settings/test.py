"""Tests: PostgreSQL and Redis when DATABASE_URL / REDIS_URL are set (always in CI)."""

import os
from datetime import timedelta
from pathlib import Path

from .base import *  # noqa: F403
from .base import CACHES, DATABASES, REDIS_URL, TOLLBOOTH, env

# Demo and test tooling (anvil, the test USDC, the demo seed); never in production.
INSTALLED_APPS = [*INSTALLED_APPS, "devtools"]  # noqa: F405

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # No DATABASE_URL: a fast in-memory database. A SQLite DATABASE_URL (the concurrency
    # pass of `make test`) gets a file next to it, so real threads and processes share it
    # through WAL and the busy timeout, as the demo does; never the named file itself.
    _name = Path(str(DATABASES["default"]["NAME"]))
    _on_file = bool(env.str("DATABASE_URL", default="")) and str(_name) != ":memory:"
    DATABASES["default"]["TEST"] = {
        "NAME": str(_name.with_name(f"test_{_name.name}")) if _on_file else ":memory:"
    }
TOLLBOOTH = {
    **TOLLBOOTH,
    "EXECUTION_LEASE": timedelta(seconds=env.int("TOLLBOOTH_EXECUTION_LEASE_SECONDS", default=30)),
    "EXECUTION_POLL_INTERVAL": env.float("TOLLBOOTH_EXECUTION_POLL_SECONDS", default=0.05),
    # Races fire 50 requests from one address at once: raised here, and the throttle tests
    # put the production defaults back (tests/security/test_throttling.py).
    "THROTTLE_RATES": {
        "api_key": env.str("TOLLBOOTH_THROTTLE_API_KEY_RATE", default="100000/min"),
        "client_address": env.str("TOLLBOOTH_THROTTLE_ADDRESS_RATE", default="100000/min"),
    },
}
EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"

# Tests that need a broker run a real worker on Redis; the rest never reach a broker.
CELERY_BROKER_URL = REDIS_URL or "memory://"
# One queue per test session, so a worker never picks up another run's messages.
CELERY_TASK_DEFAULT_QUEUE = env.str(
    "TOLLBOOTH_CELERY_QUEUE", default=f"tollbooth-tests-{os.getpid()}"
)
# Each test process counts its own throttle hits, so runs sharing a Redis never meet.
CACHES = {"default": {**CACHES["default"], "KEY_PREFIX": f"tollbooth-tests-{os.getpid()}"}}

# No TOLLBOOTH_RECEIPT_KEY: one generated key per database, shared by every process of a run.
_receipt_key_name = str(DATABASES["default"]["NAME"]).replace("/", "_")
RECEIPTS = {**RECEIPTS, "KEY_FILE": VAR_DIR / f"receipt-key-{_receipt_key_name}.hex"}  # noqa: F405
# A second database, SQLite in a file, beside PostgreSQL: the SQLite twins of the statements
# each app's sql.py writes by hand run there, on the same rows as their PostgreSQL form
# (tests/test_sql_twins.py). Only tests that name it create it.
if DATABASES["default"]["ENGINE"].endswith("postgresql"):
    DATABASES["twin"] = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(VAR_DIR / "tollbooth-twin.sqlite3"),  # noqa: F405
        "ATOMIC_REQUESTS": False,
        "OPTIONS": {"transaction_mode": "IMMEDIATE"},
        # Tables from the models as they are (the data migrations' ORM reads would reach
        # the default database, not this one).
        "TEST": {
            "NAME": str(VAR_DIR / f"test-twin-{os.getpid()}.sqlite3"),  # noqa: F405
            "MIGRATE": False,
        },
    }

# Tests receive webhooks on a local http:// server in a thread; short timeouts keep the
# slow-endpoint tests fast (production's are in base).
WEBHOOKS = {
    **WEBHOOKS,  # noqa: F405
    "REQUIRE_HTTPS": False,
    "CONNECT_TIMEOUT_SECONDS": 1.0,
    "READ_TIMEOUT_SECONDS": 1.0,
    # The receivers under test listen on loopback; the refusal tests empty this.
    "ALLOWED_NETWORKS": ["127.0.0.0/8", "::1/128"],
}
