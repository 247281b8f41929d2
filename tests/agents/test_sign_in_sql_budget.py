"""SQL budget of a wallet sign-in that is honoured (PostgreSQL), and the same by GET: the
proofs made by the official client's hook (tests/agents/siwx_sign.py), the purchase bought in
process first."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from purchases.services.fulfil.result_wait import listeners_close
from tests.x402.e2e import X402World, ask, sign_payment

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
# Measured when wallet sign-in was built: lower it as statements go, never raise it. The
# offering; the purchase signed in to; the nonce's row and the timeline event; the offering's
# upstream (may the request run work itself); the payment attempt, and its finality noted
# if the chain made it final meanwhile (an UPDATE and its event); the result; the delivery.
CEILING = 10
_CONTROL = ("SAVEPOINT", "RELEASE SAVEPOINT", "ROLLBACK TO SAVEPOINT", "BEGIN", "COMMIT")


def test_honoured_sign_in_statement_budget_by_post_and_by_get(
    x402_live_world, settings, siwx_python
):
    world = x402_live_world
    settings.X402_RESULT_WAIT_SECONDS = 30
    client = APIClient()
    payer = world.payers[0]
    try:
        paid = ask(
            client, world, payment=sign_payment(ask(client, world)["PAYMENT-REQUIRED"], payer, None)
        )
        assert paid.status_code == 200, paid.content
        proof = _official_proof(siwx_python, world, ask(client, world)["PAYMENT-REQUIRED"])
        body = {"title": "Sales", "csv": "region,units\nnorth,3\n"}
        with CaptureQueriesContext(connection) as captured:
            again = client.post(world.paid_url, body, format="json", HTTP_SIGN_IN_WITH_X=proof)
        # By GET too: the query string is the same input, a GET 402's challenge signed.
        by_get = client.get(world.paid_url, body)
        get_proof = _official_proof(siwx_python, world, by_get["PAYMENT-REQUIRED"])
        fetched = client.get(world.paid_url, body, HTTP_SIGN_IN_WITH_X=get_proof)
    finally:
        listeners_close()
    assert again.status_code == 200, again.content
    assert again.content == paid.content
    statements = [q["sql"] for q in captured.captured_queries if not q["sql"].startswith(_CONTROL)]
    assert len(statements) <= CEILING, "\n".join(statements)
    assert fetched.status_code == 200 and fetched.content == paid.content


def _official_proof(siwx_python: Path, world: X402World, required: str) -> str:
    done = subprocess.run(
        [str(siwx_python), str(ROOT / "tests/agents/siwx_sign.py"), _url(world), required],
        env={**os.environ, "BUYER_KEY": "0x" + bytes(world.payers[0].key).hex()},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return str(json.loads(done.stdout)["header"])


def _url(world: X402World) -> str:
    return f"http://testserver{world.paid_url}"
