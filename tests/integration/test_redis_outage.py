"""Issue 18 item 4: Redis stopped under a running server. Throttling degrades to each
process's memory (logged once, counted on /metrics); nothing that does not need Redis
fails, and a broker publish that does need it is left to the outbox. Redis back: shared
throttling resumes."""

from __future__ import annotations

import itertools
import re

import pytest
import requests

from purchases.services.shared.buyers import api_key_issue
from tests.conftest import CSV_INPUT
from tests.factories import BuyerFactory, OfferingFactory, fund
from tests.integration.helpers import wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
OUTAGE_LINE = "throttling: Redis unreachable"


def _fallbacks(server_url: str) -> float:
    metrics = requests.get(f"{server_url}/metrics", timeout=10).text
    found = re.search(r"^tollbooth_throttle_fallback_total (\S+)$", metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _round(
    server_url: str, key: str, paid_url: str, offering: str, n: int
) -> list[requests.Response]:
    """A buyer's whole visit: a quote, its prepaid payment, the status reads, and a 402."""
    api = f"{server_url}/api/v1"
    auth = {"Authorization": f"Bearer {key}"}
    body = {"offering": offering, "input": {**CSV_INPUT, "title": f"outage {n}"}}
    quote = requests.post(f"{api}/quotes", json=body, headers=auth, timeout=30)
    answers = [quote]
    if quote.status_code == 201:
        paid = requests.post(
            f"{api}/quotes/{quote.json()['id']}/purchase",
            json={"rail": "prepaid"},
            headers={**auth, "Idempotency-Key": f"redis-outage-pay-{n:08d}"},
            timeout=30,
        )
        answers.append(paid)
        if paid.status_code == 201:
            ref = paid.json()["purchase"]
            answers.append(requests.get(f"{api}/purchases/{ref}", headers=auth, timeout=30))
            answers.append(requests.get(f"{api}/purchases/{ref}/result", headers=auth, timeout=30))
    answers.append(requests.post(f"{server_url}{paid_url}", json=CSV_INPUT, timeout=30))
    return answers


def test_redis_stopped_mid_test_degrades_throttling_and_fails_nothing(
    private_redis, start_server, make_x402_world
):
    world = make_x402_world()
    offering = OfferingFactory.create().slug
    buyer = BuyerFactory.create()
    fund(buyer, 10_000_000)
    key = api_key_issue(buyer=buyer)
    server = start_server(
        {
            "REDIS_URL": private_redis.url,  # the throttle counters and the broker
            "X402_LOCAL_RPC_URL": world.node.rpc_url,
            "X402_LOCAL_TOKEN": world.token,
            "X402_LOCAL_RELAYER_KEY": world.relayer.key.hex(),
        }
    )
    before = _round(server.url, key, world.paid_url, offering, 0)
    assert [a.status_code for a in before] == [201, 201, 200, 202, 402], before[-1].text
    assert private_redis.keys("*throttle*")  # shared counters, in Redis
    assert _fallbacks(server.url) == 0

    private_redis.stop()
    during = [a for n in range(1, 5) for a in _round(server.url, key, world.paid_url, offering, n)]
    assert [a.status_code for a in during] == [201, 201, 200, 202, 402] * 4, [
        (a.status_code, a.text[:200]) for a in during if a.status_code >= 500
    ]
    # Only the first payment of the outage tries the broker (about 0.8 s); then the outbox
    # leaves its messages to the relay loop for a while (purchases/services/shared/outbox.py).
    slow = [a for a in during if a.elapsed.total_seconds() > 0.6]
    assert len(slow) <= 1, [(a.url, a.elapsed) for a in slow]
    # Every throttled request (quote, pay, 402) was decided in the process's memory.
    assert _fallbacks(server.url) == 12
    # Readiness reports the broker down but keeps the replica in rotation: every replica
    # shares this Redis, and the API serves without it.
    ready = requests.get(f"{server.url}/readyz", timeout=10)
    assert ready.status_code == 200, ready.text
    assert ready.json()["status"] == "degraded"
    assert ready.json()["checks"]["broker"]["ok"] is False
    log = server.log_path.read_text()
    assert log.count(OUTAGE_LINE) == 1  # once per outage, not per request

    private_redis.start()  # empty, as a restarted Redis without persistence is
    # Redis is probed again every couple of seconds: the next decisions are shared again.
    visits = itertools.count(5)
    wait_for(
        lambda: (
            _round(server.url, key, world.paid_url, offering, next(visits))
            and private_redis.keys("*throttle*")
        ),
        timeout=20,
        interval=0.5,
        message="the throttle counters back in Redis",
    )
    resumed = _fallbacks(server.url)
    after = _round(server.url, key, world.paid_url, offering, 99)
    assert [a.status_code for a in after] == [201, 201, 200, 202, 402]
    assert _fallbacks(server.url) == resumed  # no more process-memory decisions
    assert "shared limits resumed" in server.log_path.read_text()
