"""Issue 18 item 5: the database away, and a web worker killed, while a request holds a
payment id. The buyer hears 503 with Retry-After while the database is away (never 500),
and the id is never held by a request that no longer runs: the retry goes through as soon
as the database answers, or within a few heartbeats of the holder's death, not after the
120 s lease."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import requests
from django.db import connection
from x402.http.utils import decode_payment_response_header

from payments.models import PaymentAttempt
from purchases.models import IdempotencyRecord
from tests.fixtures.worker import _database_url
from tests.integration.helpers import wait_for
from tests.x402.e2e import PRICE, sign_payment

PAY_ID = "x402-outage-id-00000001"
INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\n"}


def _chain_env(world, confirmation_timeout: float) -> dict[str, str]:
    """The paying request waits for its block up to `confirmation_timeout`: its wait budget
    (the offering's expected run time, capped by X402_RESULT_WAIT_SECONDS) is as long."""
    return {
        "X402_LOCAL_RPC_URL": world.node.rpc_url,
        "X402_LOCAL_TOKEN": world.token,
        "X402_LOCAL_RELAYER_KEY": world.relayer.key.hex(),
        "X402_LOCAL_MODE": "direct",
        "X402_LOCAL_CONFIRMATION_TIMEOUT": str(confirmation_timeout),
        "X402_RESULT_WAIT_SECONDS": str(confirmation_timeout),
    }


def _world(make_x402_world, confirmation_timeout: float):
    """Mining paused; the offering's expected run time as long as the block's wait."""
    waits = timedelta(seconds=confirmation_timeout)
    return make_x402_world(no_mining=True, offering={"expected_run_time": waits})


def _server_database_url() -> str:
    """The test database, as a server process must name it (PostgreSQL or the SQLite file)."""
    if connection.vendor == "sqlite":
        return f"sqlite:///{connection.settings_dict['NAME']}"
    return _database_url()


def _broadcast(world) -> PaymentAttempt:
    """The paying request has recorded and broadcast its transaction (and waits for a block)."""
    attempt = wait_for(
        lambda: PaymentAttempt.objects.filter(tx_hash__isnull=False).first(),
        message="the prepared transaction to be committed",
    )
    wait_for(lambda: world.w3.eth.get_transaction(attempt.tx_hash), message="the broadcast")
    return attempt


def _assert_unavailable(answer: requests.Response) -> None:
    assert answer.status_code == 503, answer.text
    body = answer.json()
    assert (body["code"], body["retryable"]) == ("service_unavailable", True)
    assert answer.headers["Content-Type"] == "application/problem+json"
    assert int(answer.headers["Retry-After"]) >= 1


def _assert_resumed(answer: requests.Response, world, attempt: PaymentAttempt) -> None:
    # Settled from the recorded broadcast, then the report run in the request: its result.
    assert answer.status_code == 200, answer.text
    paid = decode_payment_response_header(answer.headers["PAYMENT-RESPONSE"])
    assert paid.success
    assert paid.transaction == attempt.tx_hash
    assert world.seller_balance() == PRICE
    assert world.relayer_sent() == 1  # resumed from the recorded broadcast, never re-sent


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_database_cut_across_the_retry_is_503_then_the_retry_goes_through_at_once(
    make_x402_world, start_server, database_proxy
):
    world = _world(make_x402_world, 4.0)
    proxied = _database_url().replace(
        f":{connection.settings_dict.get('PORT') or 5432}/", f":{database_proxy.port}/"
    )
    server = start_server({**_chain_env(world, 4.0), "DATABASE_URL": proxied})
    url = f"{server.url}{world.paid_url}"
    required = requests.post(url, json=INPUT, timeout=10)
    payment = sign_payment(required.headers["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    headers = {"PAYMENT-SIGNATURE": payment}
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(requests.post, url, json=INPUT, headers=headers, timeout=60)
        attempt = _broadcast(world)
        database_proxy.cut()  # while the request waits for its block, holding the id
        _assert_unavailable(first.result())
    # The database stays away across the buyer's retries: each one is told so.
    for _ in range(2):
        _assert_unavailable(requests.post(url, json=INPUT, headers=headers, timeout=30))
    world.node.mine()  # the transfer lands meanwhile
    database_proxy.restore()
    started = time.monotonic()
    retried = requests.post(url, json=INPUT, headers=headers, timeout=30)
    assert retried.json().get("code") != "payment_in_flight"  # nobody holds the id
    _assert_resumed(retried, world, attempt)
    assert time.monotonic() - started < 10
    assert IdempotencyRecord.objects.get().recovery_point == "finished"


@pytest.mark.sqlite_concurrency
@pytest.mark.django_db(transaction=True)
def test_a_killed_worker_holding_a_payment_id_frees_it_within_seconds(
    make_x402_world, start_server
):
    """On PostgreSQL and on the embedded SQLite file: the holder's heartbeat stops with it."""
    world = _world(make_x402_world, 120.0)
    env = {**_chain_env(world, 120.0), "DATABASE_URL": _server_database_url()}
    holder, other = start_server(env), start_server(env)  # two web workers
    required = requests.post(f"{holder.url}{world.paid_url}", json=INPUT, timeout=10)
    payment = sign_payment(required.headers["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    headers = {"PAYMENT-SIGNATURE": payment}
    with pytest.raises(requests.ReadTimeout):  # the holder waits for a block
        requests.post(f"{holder.url}{world.paid_url}", json=INPUT, headers=headers, timeout=3)
    attempt = _broadcast(world)
    holder.kill()
    killed_at = time.monotonic()
    world.node.mine()  # the transfer lands while nobody is there to answer
    answers: list[requests.Response] = []

    def retry() -> requests.Response | None:
        answer = requests.post(
            f"{other.url}{world.paid_url}", json=INPUT, headers=headers, timeout=30
        )
        answers.append(answer)
        if answer.status_code == 409:
            assert answer.json()["code"] == "payment_in_flight"
            assert int(answer.headers["Retry-After"]) >= 1
            return None
        return answer

    resumed = wait_for(retry, timeout=30, interval=0.5, message="the dead holder's lease")
    _assert_resumed(resumed, world, attempt)
    # 4 missed heartbeats of 2 s: the id is free in about 8 s, not the 120 s lease.
    assert time.monotonic() - killed_at < 15, [a.status_code for a in answers]
