"""CPU of a request through the ASGI app the web host's ASGI role serves (issue 22): a
profiler run by hand through pytest, not a test (pytest collects only `test_*.py`):

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python -m pytest \
        bench/by_hand/profile_asgi_request.py -q -s -p no:cacheprovider

Requests go through config.asgi's application (config.urls_asgi: the paid URL on the event
loop), CONCURRENCY at a time on one event loop, as uvicorn drives it. CPU is this process's,
all threads (`time.process_time`; anvil and PostgreSQL are other processes): what the hops
between the event loop and threads cost shows here and not in the synchronous profile
(bench/by_hand/profile_paid_request.py). Two kinds, each ROUNDS rounds after a warm-up:

- unpaid: N POSTs to the paid URL, each answered 402 with its terms (the middleware chain
  and the view's quote, no settlement); PROFILE_REQUESTS sets N (default 400).
- paid: N POSTs with a PAYMENT-SIGNATURE each (signed before the clock starts, a new input
  each), settled by the world's relayer on the automining session anvil, the `report` work
  run inline, answered 200 with the result; PROFILE_PAID sets N (default 40, 0 skips).

For where the CPU goes, run it under `py-spy record --gil`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import time
from collections.abc import Callable

import httpx
import pytest
from rest_framework.test import APIClient

from purchases.services.fulfil.result_wait import listeners_close
from tests.x402.e2e import X402World, ask, sign_payment

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

CONCURRENCY = 8
ROUNDS = 5
WARM_UP = 8


def _body(n: int) -> dict[str, str]:
    return {"title": f"Sales {n}", "csv": f"region,units\nnorth,{n}\n"}


def test_profile_asgi_request(x402_live_world: X402World, settings) -> None:
    settings.ROOT_URLCONF = "config.urls_asgi"
    settings.X402_RESULT_WAIT_SECONDS = 30
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request is not ours
    from config.asgi import build_application

    world, app = x402_live_world, build_application()
    unpaid = int(os.environ.get("PROFILE_REQUESTS", "400"))
    paid = int(os.environ.get("PROFILE_PAID", "40"))

    async def timed(requests: list[Callable[[httpx.AsyncClient], object]], status: int) -> float:
        """CPU per request of the requests after the first WARM_UP."""
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            gate = asyncio.Semaphore(CONCURRENCY)

            async def one(make: Callable[[httpx.AsyncClient], object]) -> None:
                async with gate:
                    answer = await make(client)  # type: ignore[misc]
                    assert answer.status_code == status, answer.text

            await asyncio.gather(*(one(make) for make in requests[:WARM_UP]))
            started = time.process_time()
            await asyncio.gather(*(one(make) for make in requests[WARM_UP:]))
            return (time.process_time() - started) / (len(requests) - WARM_UP)

    def post(n: int, payment: str | None = None) -> Callable[[httpx.AsyncClient], object]:
        headers = {"Content-Type": "application/json"}
        if payment:
            headers["PAYMENT-SIGNATURE"] = payment
        content = json.dumps(_body(n))
        return lambda client: client.post(world.paid_url, content=content, headers=headers)

    figures = {
        "unpaid (402)": [
            asyncio.run(timed([post(0)] * (WARM_UP + unpaid), 402)) for _ in range(ROUNDS)
        ]
    }
    if paid:
        client, per_round, rounds = APIClient(), WARM_UP + paid, []
        try:
            for round_ in range(ROUNDS):
                numbers = range(round_ * per_round, (round_ + 1) * per_round)
                payments = {
                    n: sign_payment(
                        ask(client, world, _body(n)).headers["PAYMENT-REQUIRED"],
                        world.payers[n % len(world.payers)],
                        None,
                    )
                    for n in numbers
                }
                rounds.append(asyncio.run(timed([post(n, payments[n]) for n in numbers], 200)))
        finally:
            listeners_close()
        figures["paid (200)"] = rounds
    print()
    for label, per_request in figures.items():
        print(
            f"{label} through the ASGI app, CPU per request in ms ({ROUNDS} rounds): "
            f"median {statistics.median(per_request) * 1e3:.2f}  "
            f"min {min(per_request) * 1e3:.2f}  max {max(per_request) * 1e3:.2f}"
        )
