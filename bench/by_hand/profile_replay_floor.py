"""What a replay costs beyond the bench's bare endpoint, part by part (issue 11's replay goal).

Not a test (pytest collects only `test_*.py`): a profiler run by hand through pytest,

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python -m pytest \
        bench/by_hand/profile_replay_floor.py -q -s -p no:cacheprovider

It serves `bench.urls` in this process (APIClient) and measures, in alternating rounds, the
app CPU (`time.process_time`; PostgreSQL and Redis are other processes) of:
- `bare`: the anchor of `make bench`'s replay figure (bench/anchors.py: the API-key
  authentication, a constant JSON answer);
- `replay`: the prepaid pay request sent again with its Idempotency-Key, as the bench sends it;
- `unthrottled`: the same replay through the view without its throttles (the bench's
  diagnostic URL).
`replay - unthrottled` is the per-key and per-address throttle (one Redis round trip);
`unthrottled - bare` is the payment-id claim (one statement that reads the stored answer and
notes the replay on the timeline), parsing the body and rendering the stored bytes.
PROFILE_REQUESTS sets the requests per side per round (default 300).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import pytest
from django.test import override_settings
from rest_framework.test import APIClient

from purchases.models import Buyer, Offering
from tests.factories import fund

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ROUNDS = 3


@override_settings(ROOT_URLCONF="bench.urls")
def test_profile_replay_floor(
    buyer: Buyer, offering: Offering, make_client: Callable[[Buyer], APIClient], settings
) -> None:
    requests = int(os.environ.get("PROFILE_REQUESTS", "300"))
    client = make_client(buyer)
    fund(buyer, 10_000_000_000)
    rates = settings.TOLLBOOTH["THROTTLE_RATES"]
    settings.TOLLBOOTH = {
        **settings.TOLLBOOTH,
        "THROTTLE_RATES": {**rates, "api_key": "1000000/min", "client_address": "1000000/min"},
    }
    body = {"offering": offering.slug, "input": {"title": "Sales", "csv": "region,units\nn,1\n"}}
    quoted = client.post("/api/v1/quotes", body, format="json")
    assert quoted.status_code == 201, quoted.content
    quote_id = quoted.json()["id"]

    def pay(path: str) -> Callable[[], object]:
        return lambda: client.post(
            path, {"rail": "prepaid"}, format="json", HTTP_IDEMPOTENCY_KEY="profile-replay-floor-1"
        )

    paid = pay(f"/api/v1/quotes/{quote_id}/purchase")()
    assert paid.status_code == 201, paid.content  # type: ignore[attr-defined]
    sides: dict[str, Callable[[], object]] = {
        "bare": lambda: client.post("/bench/bare", {"rail": "prepaid"}, format="json"),
        "replay": pay(f"/api/v1/quotes/{quote_id}/purchase"),
        "unthrottled": pay(f"/bench/unthrottled/quotes/{quote_id}/purchase"),
    }
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(ROUNDS + 1):  # the first round warms up and is not counted
        for name, send in sides.items():
            for _ in range(requests):
                started = time.process_time()
                response = send()
                spent = time.process_time() - started
                assert response.status_code in (200, 201), response.content  # type: ignore[attr-defined]
                if round_:
                    cpu[name].append(spent)

    median = {name: statistics.median(values) * 1e3 for name, values in cpu.items()}
    print()
    print(f"app CPU per request in ms, median of {ROUNDS} x {requests}:")
    for name, value in median.items():
        print(f"  {name:12s} {value:.3f}  ({value / median['bare']:.2f}x bare)")
    print(f"  throttle     {median['replay'] - median['unthrottled']:.3f}")
    print(f"  claim+parse  {median['unthrottled'] - median['bare']:.3f}")
