"""x402 with real processes: a Celery worker for one-round-trip results, and a server
SIGKILLed between broadcast and answer."""

from __future__ import annotations

import pytest
import requests
from x402.http.utils import decode_payment_response_header

from payments.models import PaymentAttempt
from purchases.models import Purchase
from tests.integration.helpers import wait_for
from tests.x402.e2e import PRICE, sign_payment

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.django_db(transaction=True)]
PAY_ID = "x402-process-id-0000001"
INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\n"}


@pytest.mark.worker
def test_happy_path_returns_the_result_in_one_round_trip(
    settings, make_x402_world, http_server, start_worker
):
    world = make_x402_world()
    settings.X402_RESULT_WAIT_SECONDS = 30
    start_worker("w1")
    url = f"{http_server}{world.paid_url}"
    required = requests.post(url, json=INPUT, timeout=10)
    assert required.status_code == 402
    payment = sign_payment(required.headers["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    paid = requests.post(url, json=INPUT, headers={"PAYMENT-SIGNATURE": payment}, timeout=60)
    assert paid.status_code == 200, paid.text
    assert paid.json()["title"] == "Sales"
    settle = decode_payment_response_header(paid.headers["PAYMENT-RESPONSE"])
    assert settle.success and settle.transaction == PaymentAttempt.objects.get().tx_hash
    assert world.seller_balance() == PRICE


def test_server_killed_between_broadcast_and_answer(make_x402_world, start_server):
    world = make_x402_world(no_mining=True)
    node = world.node
    env = {
        "X402_LOCAL_RPC_URL": node.rpc_url,
        "X402_LOCAL_TOKEN": world.token,
        "X402_LOCAL_RELAYER_KEY": world.relayer.key.hex(),
        "X402_LOCAL_MODE": "direct",
        "X402_LOCAL_CONFIRMATION_TIMEOUT": "120",
        # The paid request's wait budget (the offering's 10 s expected run time, capped by
        # this) must outlast the client's 3 s timeout: the server is still waiting when killed.
        "X402_RESULT_WAIT_SECONDS": "60",
    }
    server = start_server(env)
    url = f"{server.url}{world.paid_url}"
    required = requests.post(url, json=INPUT, timeout=10)
    payment = sign_payment(required.headers["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    with pytest.raises(requests.ReadTimeout):  # the server is waiting for a block
        requests.post(url, json=INPUT, headers={"PAYMENT-SIGNATURE": payment}, timeout=3)
    attempt = wait_for(
        lambda: PaymentAttempt.objects.filter(tx_hash__isnull=False).first(),
        message="the prepared transaction to be committed",
    )
    wait_for(lambda: world.w3.eth.get_transaction(attempt.tx_hash), message="the broadcast")
    server.kill()
    node.mine()  # the transfer lands while nobody is there to answer

    restarted = start_server(env)
    url = f"{restarted.url}{world.paid_url}"

    def retry() -> requests.Response | None:
        answer = requests.post(url, json=INPUT, headers={"PAYMENT-SIGNATURE": payment}, timeout=30)
        # Until the dead request's lease lapses (its heartbeat stopped with it: seconds, see
        # tests/integration/test_database_outage.py) the id is in flight.
        return None if answer.status_code == 409 else answer

    # The retry resumes from evidence.
    resumed = wait_for(retry, timeout=30, interval=0.5, message="the dead holder's lease")
    # The result (the work runs in the resumed request), or pending work: paid either way.
    assert resumed.status_code in (200, 202), resumed.text
    assert Purchase.objects.get().payment_state == Purchase.PaymentState.PAID
    assert (
        decode_payment_response_header(resumed.headers["PAYMENT-RESPONSE"]).transaction
        == attempt.tx_hash
    )
    assert world.seller_balance() == PRICE
    assert world.relayer_sent() == 1  # no second broadcast
