"""Races and dropped connections against a real HTTP server, PostgreSQL and a Celery worker."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlparse

import pytest
import requests

from fulfillment.models import ExecutionAttempt, Result
from payments.models import LedgerEntry, PaymentAttempt
from purchases.models import Purchase
from purchases.services.shared.buyers import api_key_issue
from tests.conftest import CSV_INPUT
from tests.integration.helpers import race, wait_for

# The races also run on the embedded SQLite default (`make test`'s second pass); the worker
# tests need PostgreSQL and Redis (the `worker` marker says so).
pytestmark = [pytest.mark.django_db(transaction=True)]
RACERS = 50


@pytest.fixture
def agent(http_server, buyer, offering):
    """An authenticated agent talking HTTP to the live server, with a fresh quote."""
    session_headers = {"Authorization": f"Bearer {api_key_issue(buyer=buyer)}"}
    quote = requests.post(
        f"{http_server}/api/v1/quotes",
        json={"offering": offering.slug, "input": CSV_INPUT},
        headers=session_headers,
        timeout=10,
    ).json()
    return http_server, session_headers, quote["id"]


def pay(base, headers, quote_id, key):
    response = requests.post(
        f"{base}/api/v1/quotes/{quote_id}/purchase",
        json={"rail": "prepaid"},
        headers={**headers, "Idempotency-Key": key},
        timeout=60,
    )
    return response.status_code, response.json()


@pytest.mark.sqlite_concurrency
def test_fifty_concurrent_requests_with_one_key_debit_once(agent, buyer):
    base, headers, quote_id = agent
    answers = race(RACERS, lambda i: pay(base, headers, quote_id, "same-key-for-everyone-01"))
    statuses = sorted({status for status, _ in answers})
    assert set(statuses) <= {201, 409}, statuses
    created = [body for status, body in answers if status == 201]
    in_flight = [body for status, body in answers if status == 409]
    assert created, "at least the winner gets the purchase"
    assert not [status for status, _ in answers if status >= 500]
    assert len({body["purchase"] for body in created}) == 1
    assert all(body["code"] == "payment_in_flight" for body in in_flight)
    assert LedgerEntry.objects.filter(buyer=buyer, kind="purchase_debit").count() == 1
    assert Purchase.objects.count() == 1
    assert PaymentAttempt.objects.count() == 1
    # Every loser retrying now gets the one stored answer.
    status, body = pay(base, headers, quote_id, "same-key-for-everyone-01")
    assert (status, body["purchase"]) == (201, created[0]["purchase"])


@pytest.mark.sqlite_concurrency
def test_fifty_concurrent_keys_on_one_quote_pay_once(agent, buyer):
    base, headers, quote_id = agent
    answers = race(RACERS, lambda i: pay(base, headers, quote_id, f"distinct-key-{i:04d}-xxxxxx"))
    created = [body for status, body in answers if status == 201]
    # Same buyer, same input, inside the duplicate window: every other key is answered
    # with the one purchase (200, marked), never charged.
    duplicates = [body for status, body in answers if status == 200]
    assert len(created) == 1
    assert len(duplicates) == RACERS - 1, answers
    assert {body["duplicate_of"] for body in duplicates} == {created[0]["purchase"]}
    assert LedgerEntry.objects.filter(buyer=buyer, kind="purchase_debit").count() == 1
    assert PaymentAttempt.objects.count() == 1


def _send_and_hang_up(base: str, path: str, headers: dict[str, str], body: dict) -> None:
    """Send a full request and close the socket without reading the answer."""
    url = urlparse(base)
    payload = json.dumps(body).encode()
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: {url.netloc}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        "Connection: close",
    ]
    head += [f"{name}: {value}" for name, value in headers.items()]
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)


@pytest.mark.worker
def test_dropped_connection_then_retry_gets_the_same_purchase_and_result(
    agent, buyer, start_worker
):
    base, headers, quote_id = agent
    start_worker("w1")
    key = "dropped-connection-key-01"
    _send_and_hang_up(
        base,
        f"/api/v1/quotes/{quote_id}/purchase",
        {**headers, "Idempotency-Key": key},
        {"rail": "prepaid"},
    )

    def retry():
        status, body = pay(base, headers, quote_id, key)
        return body if status == 201 else None

    body = wait_for(retry, timeout=30, interval=0.2, message="the retry to get the stored answer")
    ref = body["purchase"]

    def fetch_result() -> requests.Response | None:
        response = requests.get(
            f"{base}/api/v1/purchases/{ref}/result", headers=headers, timeout=10
        )
        return response if response.status_code == 200 else None

    result = wait_for(fetch_result, timeout=60, interval=0.2, message="the result")
    assert result.json()["title"] == "Sales"
    assert LedgerEntry.objects.filter(buyer=buyer, kind="purchase_debit").count() == 1
    assert ExecutionAttempt.objects.count() == 1
    assert Result.objects.count() == 1
    # A retry after delivery still answers with the same purchase, never a second charge.
    assert pay(base, headers, quote_id, key) == (201, body)


@pytest.mark.worker
def test_one_key_fifty_times_runs_the_work_once_on_a_real_worker(agent, buyer, start_worker):
    base, headers, quote_id = agent
    start_worker("w1")
    start_worker("w2")
    answers = race(RACERS, lambda i: pay(base, headers, quote_id, "one-key-real-worker-01"))
    ref = next(body["purchase"] for status, body in answers if status == 201)
    wait_for(
        lambda: Purchase.objects.get(ref=ref).fulfillment_state == "succeeded",
        timeout=60,
        message="the execution to finish",
    )
    assert LedgerEntry.objects.filter(buyer=buyer, kind="purchase_debit").count() == 1
    assert ExecutionAttempt.objects.count() == 1
    assert Result.objects.count() == 1
