"""The bench cannot rot: `bench/run.py --scale smoke` runs every registered benchmark.

It asserts the table's shape only (every registered module answers with numeric ratios or
"not present", exit 0), never a speed: benchmarks measure, tests do not time.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from bench.run import NOT_PRESENT, REGISTRY, bench_database_url
from tests.fixtures.worker import _database_url

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.postgres
# Generous: the smoke run is short on an idle machine (about a minute) but a loaded CI
# machine has taken over three; the limit only catches a hang.
@pytest.mark.timeout(900)
def test_smoke_run_lists_every_registered_figure_with_numeric_ratios(tmp_path: Path) -> None:
    if not settings.REDIS_URL:
        pytest.skip("the bench serves the production settings, which need REDIS_URL")
    # A database of its own on the test server, never the one `make bench` keeps.
    database = f"{settings.DATABASES['default']['NAME']}_bench_smoke"
    database_url = bench_database_url(_database_url(), database)
    report_path = tmp_path / "last.json"
    env = {**os.environ, "REDIS_URL": settings.REDIS_URL}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    # Set by the browser tests for their live server; production settings' startup check
    # (serve.py) rightly refuses to serve with it.
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    try:
        result = subprocess.run(
            [
                sys.executable,
                "bench/run.py",
                "--scale",
                "smoke",
                "--database-url",
                database_url,
                "--fresh",
                "--json",
                str(report_path),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=840,
            check=False,
        )
    finally:
        _drop(database_url)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]

    report = json.loads(report_path.read_text())
    assert report["scale"] == "smoke"
    rows = report["figures"]
    assert {row["module"] for row in rows} == set(REGISTRY)
    for row in rows:
        if row["status"] == NOT_PRESENT:
            assert row["detail"] == NOT_PRESENT
            assert row["figure"] in result.stdout  # a line of the table says so
            continue
        assert row["status"] == "measured", row
        assert row["ratios"], row
        assert all(isinstance(r, float) and math.isfinite(r) and r > 0 for r in row["ratios"])
        assert row["min"] <= row["median"] <= row["max"]
        assert row["figure"] in result.stdout
    # This branch's own figures are always there.
    names = {row["figure"] for row in rows}
    assert {
        "replay vs bare endpoint",
        "prepaid purchase vs one-INSERT endpoint",
        "direct settlement's chain CPU, web3 / plain JSON-RPC",
    } <= names


def _drop(database_url: str) -> None:
    import psycopg
    from psycopg import sql

    name = database_url.rsplit("/", 1)[1]
    admin_url = database_url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
