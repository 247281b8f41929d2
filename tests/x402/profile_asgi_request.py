"""CPU of the ASGI app's request path around the paid view (issue 22): a profiler run by
hand through pytest, not a test (pytest collects only `test_*.py`):

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python -m pytest \
        tests/x402/profile_asgi_request.py -q -s -p no:cacheprovider

N unpaid POSTs to the paid URL (each answered 402 with its terms: the middleware chain, the
view's quote, no settlement) through the ASGI application the web host's ASGI role serves
(config.asgi, config.urls_asgi), CONCURRENCY at a time on one event loop, as uvicorn drives
it. CPU is this process's, all threads (`time.process_time`): what the middleware chain's
hops between the event loop and threads cost shows here and not in the WSGI profile
(tests/x402/profile_paid_request.py). PROFILE_REQUESTS sets N (default 400).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import time

import httpx
import pytest

from tests.x402.e2e import X402World

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

CONCURRENCY = 8
ROUNDS = 5


def test_profile_asgi_request(x402_live_world: X402World, settings) -> None:
    settings.ROOT_URLCONF = "config.urls_asgi"
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request is not ours
    from config.asgi import build_application

    app = build_application()
    requests = int(os.environ.get("PROFILE_REQUESTS", "400"))
    body = json.dumps({"title": "Sales", "csv": "region,units\nnorth,3\n"})

    async def one_round() -> float:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            gate = asyncio.Semaphore(CONCURRENCY)

            async def ask() -> None:
                async with gate:
                    answer = await client.post(
                        x402_live_world.paid_url,
                        content=body,
                        headers={"Content-Type": "application/json"},
                    )
                    assert answer.status_code == 402, answer.text

            await asyncio.gather(*(ask() for _ in range(10)))  # warm-up
            started = time.process_time()
            await asyncio.gather(*(ask() for _ in range(requests)))
            return (time.process_time() - started) / requests

    per_request = [asyncio.run(one_round()) for _ in range(ROUNDS)]
    print()
    print(
        f"unpaid POST through the ASGI app, CPU per request in ms ({ROUNDS} rounds of "
        f"{requests}): median {statistics.median(per_request) * 1e3:.2f}  "
        f"min {min(per_request) * 1e3:.2f}  max {max(per_request) * 1e3:.2f}"
    )
