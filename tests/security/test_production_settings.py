"""Production settings refuse to start weak, and start hardened (issue 8, 9).

Each case imports the production settings in a fresh interpreter with only the given
environment, as a deployment would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOOD = {
    "DJANGO_SETTINGS_MODULE": "config.settings.production",
    "DJANGO_SECRET_KEY": "k" * 20 + "9f2c1b7e6a5d4c3b2a1f0e9d8c7b6a5f4e3d",
    "DATABASE_URL": "postgres://tollbooth@db.internal:5432/tollbooth",
    "REDIS_URL": "redis://redis.internal:6379/0",
    "DJANGO_ALLOWED_HOSTS": "api.tollbooth.example",
    "TOLLBOOTH_METRICS_TOKEN": "metrics-token-for-the-scraper-0001",
    # Generated per run: no signing key lives in the repo.
    "TOLLBOOTH_RECEIPT_KEY": "0x" + os.urandom(32).hex(),
}
PROBE = (
    "import django, json; django.setup(); from django.conf import settings as s; "
    "print(json.dumps({k: getattr(s, k) for k in ("
    "'DEBUG', 'SECURE_SSL_REDIRECT', 'SECURE_HSTS_SECONDS', 'SECURE_HSTS_INCLUDE_SUBDOMAINS', "
    "'SESSION_COOKIE_SECURE', 'CSRF_COOKIE_SECURE', 'ALLOWED_HOSTS', 'TOLLBOOTH_METRICS_TOKEN')}"
    ", default=str)); db = s.DATABASES['default']; "
    "print(db['ENGINE'], db['CONN_MAX_AGE'], db['CONN_HEALTH_CHECKS'], "
    "s.STORAGES['staticfiles']['BACKEND'])"
)


def start(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DATABASE_", "REDIS_"))
    }
    base.pop("TOLLBOOTH_METRICS_TOKEN", None)
    base.pop("TOLLBOOTH_RECEIPT_KEY", None)
    base["TOLLBOOTH_VAR_DIR"] = str(ROOT / "var")
    return subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_good_production_settings_start_hardened():
    result = start(GOOD)
    assert result.returncode == 0, result.stderr
    values_line, database = result.stdout.strip().splitlines()[-2:]
    engine, max_age, health_checks, static_backend = database.split()
    values = json.loads(values_line)
    assert values["DEBUG"] is False
    assert values["SECURE_SSL_REDIRECT"] is True
    assert values["SECURE_HSTS_SECONDS"] >= 31_536_000
    assert values["SECURE_HSTS_INCLUDE_SUBDOMAINS"] is True
    assert values["SESSION_COOKIE_SECURE"] is values["CSRF_COOKIE_SECURE"] is True
    assert values["ALLOWED_HOSTS"] == ["api.tollbooth.example"]
    assert engine.endswith("postgresql")
    # Persistent connections, checked before reuse (docs/deployment.md).
    assert (int(max_age), health_checks) == (60, "True")
    assert static_backend == "whitenoise.storage.CompressedManifestStaticFilesStorage"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"DJANGO_SECRET_KEY": None}, "DJANGO_SECRET_KEY"),
        ({"DJANGO_SECRET_KEY": "x"}, "DJANGO_SECRET_KEY"),
        ({"DJANGO_SECRET_KEY": "insecure-local-only-key" + "x" * 40}, "DJANGO_SECRET_KEY"),
        ({"DATABASE_URL": None}, "DATABASE_URL"),
        ({"REDIS_URL": None}, "REDIS_URL"),
        ({"DJANGO_ALLOWED_HOSTS": None}, "DJANGO_ALLOWED_HOSTS"),
        ({"DJANGO_ALLOWED_HOSTS": "api.tollbooth.example,testserver"}, "testserver"),
        ({"DJANGO_ALLOWED_HOSTS": "*"}, "DJANGO_ALLOWED_HOSTS"),
        ({"TOLLBOOTH_METRICS_TOKEN": None}, "TOLLBOOTH_METRICS_TOKEN"),
        ({"TOLLBOOTH_RECEIPT_KEY": None}, "TOLLBOOTH_RECEIPT_KEY"),
    ],
    ids=[
        "no-secret",
        "short-secret",
        "default-secret",
        "no-database",
        "no-redis",
        "no-hosts",
        "testserver",
        "wildcard",
        "open-metrics",
        "no-receipt-key",
    ],
)
def test_weak_production_settings_refuse_to_start(change, message):
    env = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    result = start(env)
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and message in result.stderr


@pytest.mark.parametrize("entry_point", ["config.wsgi", "config.asgi", "config.celery_app"])
def test_server_entry_points_default_to_production(entry_point):
    """Started with no settings named, a server refuses instead of serving the demo's."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DATABASE_"))}
    base["TOLLBOOTH_VAR_DIR"] = str(ROOT / "var")
    result = subprocess.run(
        [sys.executable, "-c", f"import {entry_point}; import django; django.setup()"],
        cwd=ROOT,
        env=base,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and "DJANGO_SECRET_KEY" in result.stderr
