"""`make rehearsal` (scripts/rehearsal.py) as CI runs it, once per session (issue 35, part 4):
production settings on PostgreSQL and Redis, gunicorn, a Celery worker and beat, anvil
impersonating Base, the stock x402 client paying direct and through the CDP-authenticated
facilitator double, a refund paid back. Every line of its proof table must be there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLAIMS = (
    "Base's USDC impersonated",
    "production settings, catalog file",
    "stock x402 client, direct",
    "stock x402 client, facilitator",
    "refund paid back",
    "finality; refund closed on evidence",
)
# PostgreSQL and Redis, as production: skipped without them locally, required in CI.
pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def test_the_mainnet_rehearsal_proves_every_claim() -> None:
    database_url, redis_url = os.environ["DATABASE_URL"], os.environ["REDIS_URL"]
    suite_db = urlsplit(database_url).path.strip("/") or "tollbooth"
    redis_db = urlsplit(redis_url).path.strip("/") or "0"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "X402_"))},
        # Its own database and Redis db beside the suite's, never the suite's own.
        "REHEARSAL_DATABASE_NAME": f"{suite_db}_rehearsal",
        "REHEARSAL_REDIS_DB": "14" if redis_db == "15" else "15",
    }
    done = subprocess.run(
        [sys.executable, "scripts/rehearsal.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-4000:]
    proved = out[out.index("REHEARSAL PROVED") :].splitlines()
    for claim in CLAIMS:
        assert any(line.strip().startswith(f"ok  {claim}") for line in proved), (claim, out)
    lines = {claim: next(line for line in proved if claim in line) for claim in CLAIMS}
    assert "'USD Coin' v2 at 0x833589fC" in lines["Base's USDC impersonated"]
    assert "depth 3 >= 3" in lines["stock x402 client, direct"]
    assert "0 refused" in lines["stock x402 client, facilitator"]
    assert "paid by 'payout 1 (finance)'" in lines["finality; refund closed on evidence"]
    assert proved[-1].startswith("REHEARSAL OK in ")
