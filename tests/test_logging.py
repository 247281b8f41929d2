"""What the logs say, and what they never say.

A status URL's token is its credential: Django's request log (4xx lines) must not hold it,
as gunicorn's access log already does not (tests/test_gunicorn_config.py). A 402 on a paid
URL is the protocol's first step, not a warning; other 4xx stay warnings. And a manage.py
call prints no django-axes banner nor kombu's "No hostname" warning (the embedded broker).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.http import HttpResponse
from django.test import RequestFactory
from django.utils.log import log_response

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret-capability-token-0123456789"


@pytest.mark.django_db
def test_a_status_url_token_never_reaches_the_request_log(client, caplog):
    caplog.set_level(logging.INFO)
    response = client.get(f"/x402/purchases/pur_missing/{TOKEN}")
    assert response.status_code == 404
    logged = [record.getMessage() for record in caplog.records]
    assert any("/x402/purchases/pur_missing/[redacted]" in line for line in logged), logged
    assert not any(TOKEN in line for line in logged)


@pytest.mark.parametrize(
    ("path", "status", "logged"),
    [
        ("/x402/csv-report", 402, False),  # the x402 handshake: every buyer's first call
        ("/x402/csv-report", 409, True),
        ("/api/v1/purchases", 402, True),
    ],
)
def test_only_the_paid_urls_402_is_quiet(caplog, path, status, logged):
    caplog.set_level(logging.INFO)
    log_response(
        "%s: %s",
        "answer",
        path,
        response=HttpResponse(status=status),
        request=RequestFactory().get(path),
    )
    assert any(r.name == "django.request" for r in caplog.records) is logged


def test_a_manage_py_call_prints_no_axes_banner_nor_kombu_hostname_warning(tmp_path):
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DJANGO_SETTINGS_MODULE")},
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "TOLLBOOTH_VAR_DIR": str(tmp_path),
    }
    # The embedded default (no REDIS_URL): the filesystem broker, as the demo runs.
    code = "from config.celery_app import app; print(app.connection_for_write().info()['hostname'])"
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "localhost" in done.stdout
    assert "AXES: BEGIN" not in done.stderr, done.stderr
    assert "No hostname" not in done.stderr, done.stderr
