"""A paid request waits for its settlement and its work within one budget: the offering's
expected run time, capped by X402_RESULT_WAIT_SECONDS (purchases.services.x402.outcomes
x402_wait_budget), never the network's whole confirmation_timeout.

On a chain that does not mine within the budget (anvil with mining paused; the network's
confirmation_timeout far longer), the paying request answers 202 settlement_pending with the
status URL while its transaction is still in the pool, and records the payment as pending,
never failed. Once the block is mined, the status URL settles it and gives the result; the
work runs once. Both ways the paid URL is served: blocking (WSGI, config.urls) and with
the wait on the event loop (ASGI, doors/x402/paid_async.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests
from rest_framework.test import APIClient

from fulfillment.models import ExecutionAttempt
from payments.models import PaymentAttempt
from purchases.models import Purchase
from purchases.services.fulfil.result_wait import listeners_close
from tests.x402.e2e import NETWORK, PRICE, MakeWorld, X402World, sign_payment

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
INPUT = {"title": "Budget", "csv": "region,units\nnorth,3\n"}
# How long the test gives the paying request to answer. Far below the network's own
# confirmation_timeout: a request that waited for that instead would not have answered.
ANSWER_BOUND_SECONDS = 60.0
CONFIRMATION_TIMEOUT = 300.0


def _world(make_x402_world: MakeWorld, settings: Any) -> X402World:
    world = make_x402_world(no_mining=True, offering={"expected_run_time": timedelta(seconds=1)})
    settings.X402_NETWORKS[NETWORK]["confirmation_timeout"] = CONFIRMATION_TIMEOUT
    settings.X402_RESULT_WAIT_SECONDS = 30  # the cap: the offering's 1 s decides below it
    return world


def _answered_before_the_block(world: X402World, pay: Callable[[], Any]) -> Any:
    """Pays in a thread; the chain mines nothing meanwhile. Returns the answer."""
    answers: list[Any] = []
    payer = threading.Thread(target=lambda: answers.append(pay()), daemon=True)
    payer.start()
    payer.join(timeout=ANSWER_BOUND_SECONDS)
    assert answers, "the paid request still waits, as if for the network's whole timeout"
    assert world.relayer_sent() == 1  # broadcast...
    assert world.w3.eth.get_transaction_count(world.relayer.address, "latest") == 0  # not mined
    return answers[0]


def _assert_settlement_pending(answer_status: int, body: dict[str, Any], headers: Any) -> str:
    assert answer_status == 202, body
    assert body["status"] == "settlement_pending"
    attempt = PaymentAttempt.objects.get()
    assert body["transaction"] == attempt.tx_hash  # what is awaited: this transaction
    assert body["next_action"] == "poll_status_url"
    assert headers["Location"] == body["status_url"]
    assert int(headers["Retry-After"]) > 0
    # Pending, never failed: the money may still move.
    purchase = Purchase.objects.get()
    assert purchase.payment_state == Purchase.PaymentState.SETTLEMENT_PENDING
    assert attempt.state == PaymentAttempt.State.SETTLEMENT_PENDING
    assert not ExecutionAttempt.objects.exists()
    return str(body["status_url"])


def _status_url_gives_the_result_once(world: X402World, status_url: str) -> None:
    world.node.mine()
    client = APIClient()
    path = urlsplit(status_url).path
    first = client.get(path)
    assert first.status_code == 200, first.content
    again = client.get(path)
    assert again.status_code == 200 and again.content == first.content
    purchase = Purchase.objects.get()
    assert purchase.payment_state == Purchase.PaymentState.PAID
    assert purchase.fulfillment_state == Purchase.FulfillmentState.SUCCEEDED
    assert ExecutionAttempt.objects.count() == 1  # the work ran once
    assert world.seller_balance() == PRICE
    listeners_close()  # its LISTEN connection would keep the test database open


def test_a_blocking_paid_request_answers_202_when_the_block_outlasts_its_budget(
    make_x402_world: MakeWorld, settings
) -> None:
    world = _world(make_x402_world, settings)
    settings.ROOT_URLCONF = "config.urls"  # the WSGI paid view: the wait blocks its thread
    client = APIClient()
    offer = client.post(world.paid_url, INPUT, format="json")
    payment = sign_payment(offer.headers["PAYMENT-REQUIRED"], world.payers[0], None)

    def pay() -> Any:
        return client.post(world.paid_url, INPUT, format="json", HTTP_PAYMENT_SIGNATURE=payment)

    paid = _answered_before_the_block(world, pay)
    status_url = _assert_settlement_pending(paid.status_code, paid.json(), paid.headers)
    _status_url_gives_the_result_once(world, status_url)


def test_a_paid_request_waiting_on_the_event_loop_answers_202_when_the_block_outlasts_its_budget(
    make_x402_world: MakeWorld, settings, start_asgi_server
) -> None:
    world = _world(make_x402_world, settings)
    settings.ALLOWED_HOSTS = ["127.0.0.1", "testserver"]
    url = f"{start_asgi_server()}{world.paid_url}"
    offer = requests.post(url, json=INPUT, timeout=30)
    payment = sign_payment(offer.headers["PAYMENT-REQUIRED"], world.payers[0], None)

    def pay() -> requests.Response:
        return requests.post(
            url, json=INPUT, headers={"PAYMENT-SIGNATURE": payment}, timeout=CONFIRMATION_TIMEOUT
        )

    paid = _answered_before_the_block(world, pay)
    status_url = _assert_settlement_pending(paid.status_code, paid.json(), paid.headers)
    _status_url_gives_the_result_once(world, status_url)
