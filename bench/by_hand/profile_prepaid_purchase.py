"""CPU of one prepaid quote, pay and replay in this process, and where it goes (issue 11).

Not a test (pytest collects only `test_*.py`): a profiler run by hand through pytest, for
the suite's fixtures (a funded buyer, its API key, committed rows):

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python -m pytest \
        bench/by_hand/profile_prepaid_purchase.py -q -s -p no:cacheprovider

Each round is what `make bench` sends (bench/api_overhead.py) through the real views
(APIClient): POST /api/v1/quotes for a new input, POST /api/v1/quotes/<id>/purchase with
a new Idempotency-Key (paid from the balance, committed, the outbox relayed after commit),
then the same pay request again (a replay). CPU is this process's (`time.process_time`;
PostgreSQL and Redis are other processes). After WARM_UP rounds, N are timed alone (the
figures) and N more under cProfile with a CPU clock (the breakdown, per step; the profiler
adds overhead of its own). PROFILE_REQUESTS sets N (default 60); PROFILE_TOP how many of
our functions to list by cumulative CPU (default 30); PROFILE_OUT a file prefix to dump the
raw profiles to (<prefix>.<step>).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import time
from collections.abc import Callable
from functools import partial

import pytest
from rest_framework.test import APIClient

from bench.by_hand.profiling import print_ours
from purchases.models import Buyer, Offering
from tests.factories import fund

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

WARM_UP = 5
STEPS = ("quote", "pay", "replay")


def test_profile_prepaid_purchase(
    buyer: Buyer, offering: Offering, make_client: Callable[[Buyer], APIClient], settings
) -> None:
    client = make_client(buyer)
    fund(buyer, 10_000_000_000)  # every round's price, and more
    requests = int(os.environ.get("PROFILE_REQUESTS", "60"))
    top = int(os.environ.get("PROFILE_TOP", "30"))
    rates = settings.TOLLBOOTH["THROTTLE_RATES"]
    settings.TOLLBOOTH = {
        **settings.TOLLBOOTH,
        "THROTTLE_RATES": {**rates, "api_key": "100000/min", "client_address": "100000/min"},
    }
    profilers = {step: cProfile.Profile(time.process_time) for step in STEPS}
    plain: dict[str, list[float]] = {step: [] for step in STEPS}
    profiled: dict[str, list[float]] = {step: [] for step in STEPS}

    def timed(n: int, step: str, send: Callable[[], object]) -> object:
        phase = None if n < WARM_UP else plain if n < WARM_UP + requests else profiled
        profiler = profilers[step]
        started = time.process_time()
        if phase is profiled:
            profiler.enable()
        response = send()
        if phase is profiled:
            profiler.disable()
        if phase is not None:
            phase[step].append(time.process_time() - started)
        return response

    for n in range(WARM_UP + 2 * requests):
        data = {"title": f"Sales {n}", "csv": f"region,units\nnorth,{n}\n"}
        body = {"offering": offering.slug, "input": data}
        quoted = timed(n, "quote", partial(client.post, "/api/v1/quotes", body, format="json"))
        assert quoted.status_code == 201, quoted.content  # type: ignore[attr-defined]
        quote_id = quoted.json()["id"]  # type: ignore[attr-defined]

        pay = partial(
            client.post,
            f"/api/v1/quotes/{quote_id}/purchase",
            {"rail": "prepaid"},
            format="json",
            HTTP_IDEMPOTENCY_KEY=f"profile-prepaid-{n:08d}",
        )
        paid = timed(n, "pay", pay)
        assert paid.status_code == 201, paid.content  # type: ignore[attr-defined]
        replayed = timed(n, "replay", pay)
        assert replayed.status_code == 201, replayed.content  # type: ignore[attr-defined]
        assert replayed.content == paid.content  # type: ignore[attr-defined]

    print()
    print(f"prepaid API, CPU per request in ms ({WARM_UP} warm-up rounds not counted):")
    for step in STEPS:
        for label, cpu in (("plain", plain[step]), ("profiled", profiled[step])):
            print(
                f"  {step:6s} {label:9s} n={len(cpu)}  median {statistics.median(cpu) * 1e3:.2f}"
                f"  mean {statistics.mean(cpu) * 1e3:.2f}  min {min(cpu) * 1e3:.2f}"
                f"  max {max(cpu) * 1e3:.2f}"
            )
    for step in STEPS:
        print(f"-- {step}")
        print_ours(pstats.Stats(profilers[step]), top)
        if os.environ.get("PROFILE_OUT"):
            profilers[step].dump_stats(f"{os.environ['PROFILE_OUT']}.{step}")
