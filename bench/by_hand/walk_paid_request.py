"""The walk of one paid x402 request from the view to the answer (bench/walk.py, issue 20).

Not a test (pytest collects only `test_*.py`): run by hand through pytest, for the suite's
fixtures (the session anvil, a fresh test USDC, committed rows):

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python -m pytest \\
        bench/by_hand/walk_paid_request.py -q -s -p no:cacheprovider

The request is a POST /x402/<slug> through the real view (APIClient) with a signed
PAYMENT-SIGNATURE for a new input: direct settlement, the `report` executor inline,
answered 200. WARM_UP requests first, so the walk is a warm process's, not its first
imports'.
"""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from bench.walk import Walk
from purchases.services.fulfil.result_wait import listeners_close
from tests.x402.e2e import X402World, ask, sign_payment

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

WARM_UP = 3


def test_walk_paid_request(x402_live_world: X402World, settings) -> None:
    world, client = x402_live_world, APIClient()
    # The paid URL as every x402 test serves it (tests/x402/conftest.py's autouse fixture,
    # which this folder does not load): its wait handed to an event loop.
    settings.ROOT_URLCONF = "config.urls_asgi"
    settings.X402_RESULT_WAIT_SECONDS = 30
    bodies = [
        {"title": f"Walk {n}", "csv": f"region,units\nnorth,{n}\n"} for n in range(WARM_UP + 1)
    ]
    payments = [
        sign_payment(ask(client, world, body).headers["PAYMENT-REQUIRED"], world.payers[0], None)
        for body in bodies
    ]
    try:
        for body, payment in zip(bodies[:-1], payments[:-1], strict=True):
            assert ask(client, world, body, payment=payment).status_code == 200
        with Walk() as walk:
            paid = ask(client, world, bodies[-1], payment=payments[-1])
        assert paid.status_code == 200, paid.content
    finally:
        listeners_close()
    print()
    print(walk.report("one paid x402 request"))
