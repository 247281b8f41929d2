"""CPU of one paid x402 request in this process, and where it goes (issue 11).

Not a test (pytest collects only `test_*.py`): a profiler run by hand through pytest, for
the suite's fixtures (the session anvil, a fresh test USDC, committed rows):

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python -m pytest \
        bench/by_hand/profile_paid_request.py -q -s -p no:cacheprovider

Each request is a POST /x402/<slug> through the real view (APIClient) with a freshly signed
PAYMENT-SIGNATURE for a new input (its 402 asked beforehand): direct settlement by the
world's relayer, the `report` executor run inline, answered 200 with the result. The
authorizations are signed before the clock starts. CPU is this process's
(`time.process_time`; anvil and PostgreSQL are other processes). After WARM_UP requests,
N are timed alone (the figure) and N more under cProfile with a CPU clock (the breakdown;
the profiler adds overhead of its own). PROFILE_REQUESTS sets N (default 60); PROFILE_TOP
how many of our functions to list by cumulative CPU (default 40); PROFILE_OUT a file to
dump the raw profile to; PROFILE_CPROFILE=0 skips the cProfile half (for a sampling
profiler outside, e.g. `py-spy record --format raw -- .venv/bin/python -m pytest ...`).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import time

import pytest
from rest_framework.test import APIClient

from bench.by_hand.profiling import print_ours
from purchases.services.fulfil.result_wait import listeners_close
from tests.x402.e2e import X402World, ask, sign_payment

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

WARM_UP = 5


def test_profile_paid_request(x402_live_world: X402World, settings) -> None:
    world, client = x402_live_world, APIClient()
    # The paid URL as every x402 test serves it (tests/x402/conftest.py's autouse fixture,
    # which this folder does not load): its wait handed to an event loop.
    settings.ROOT_URLCONF = "config.urls_asgi"
    settings.X402_RESULT_WAIT_SECONDS = 30
    requests = int(os.environ.get("PROFILE_REQUESTS", "60"))
    top = int(os.environ.get("PROFILE_TOP", "40"))
    use_cprofile = os.environ.get("PROFILE_CPROFILE", "1") != "0"
    total = WARM_UP + (2 if use_cprofile else 1) * requests
    bodies = [{"title": f"Sales {n}", "csv": f"region,units\nnorth,{n}\n"} for n in range(total)]
    # Every payment pays a quote of its own (the 402 for its input), asked before the clock.
    payments = [
        sign_payment(
            ask(client, world, body).headers["PAYMENT-REQUIRED"],
            world.payers[n % len(world.payers)],
            None,
        )
        for n, body in enumerate(bodies)
    ]
    profiler = cProfile.Profile(time.process_time)  # CPU, not the wait on the database or chain
    plain: list[float] = []
    profiled: list[float] = []
    try:
        for n, (body, payment) in enumerate(zip(bodies, payments, strict=True)):
            # Warm-up, then N requests timed alone (the figure), then N under the profiler.
            phase = None if n < WARM_UP else plain if n < WARM_UP + requests else profiled
            started = time.process_time()
            if phase is profiled:
                profiler.enable()
            paid = ask(client, world, body, payment=payment)
            if phase is profiled:
                profiler.disable()
            if phase is not None:
                phase.append(time.process_time() - started)
            assert paid.status_code == 200, paid.content
    finally:
        listeners_close()

    print()
    print(f"paid x402 requests, CPU per request in ms ({WARM_UP} warm-up not counted):")
    for label, cpu in (("plain", plain), ("profiled", profiled)):
        if not cpu:
            continue
        print(
            f"  {label:9s} n={len(cpu)}  median {statistics.median(cpu) * 1e3:.1f}"
            f"  mean {statistics.mean(cpu) * 1e3:.1f}  min {min(cpu) * 1e3:.1f}"
            f"  max {max(cpu) * 1e3:.1f}"
        )
    if not use_cprofile:
        return
    print_ours(pstats.Stats(profiler), top)
    if os.environ.get("PROFILE_OUT"):
        profiler.dump_stats(os.environ["PROFILE_OUT"])  # for pstats, snakeviz, ...
