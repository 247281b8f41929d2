"""A paid request waiting for its block holds no thread (doors/x402/paid_async.py).

The ASGI app (config/asgi.py) serves the paid URL with ONE thread for synchronous work
(TOLLBOOTH_X402_THREADS=1) on a chain that mines only when told. Several buyers pay at once:
every payment is broadcast (all are in the pool together) while none is mined yet, which a
wait holding the only thread would forbid (the second payment could not be recorded until
the first was mined). One block then settles them all, and each buyer gets its result.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import requests

from payments.models import PaymentAttempt
from purchases.models import Purchase
from tests.x402.e2e import NETWORK, PRICE, sign_payment

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
INPUT = {"title": "Waiting", "csv": "region,units\nnorth,3\n"}


def _pay(url: str, payer, index: int, answers: list[requests.Response | None]) -> None:  # type: ignore[no-untyped-def]
    body = {**INPUT, "title": f"Waiting {index}"}
    required = requests.post(url, json=body, timeout=30)
    if required.status_code != 402:
        answers[index] = required
        return
    payment = sign_payment(
        required.headers["PAYMENT-REQUIRED"], payer, f"x402-async-wait-{index:04d}-id"
    )
    answers[index] = requests.post(
        url, json=body, headers={"PAYMENT-SIGNATURE": payment}, timeout=60
    )


def test_more_payments_wait_for_their_block_at_once_than_threads(
    make_x402_world, settings, start_asgi_server
):
    # Long enough that no wait ends by timing out: only the block ends them. The request's
    # wait budget (the offering's expected run time, capped) bounds the settlement's wait too.
    world = make_x402_world(no_mining=True, offering={"expected_run_time": timedelta(seconds=60)})
    settings.X402_NETWORKS[NETWORK]["confirmation_timeout"] = 60.0
    settings.X402_RESULT_WAIT_SECONDS = 60  # `report` runs in the request: 200 with the result
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "X402_THREADS": 1}
    settings.ALLOWED_HOSTS = ["127.0.0.1"]
    base = start_asgi_server()
    url = f"{base}{world.paid_url}"
    payers = world.payers
    answers: list[requests.Response | None] = [None] * len(payers)
    buyers = [
        threading.Thread(target=_pay, args=(url, payer, i, answers), daemon=True)
        for i, payer in enumerate(payers)
    ]
    for buyer in buyers:
        buyer.start()

    # Every payment broadcast and waiting at once, on one thread: none mined yet.
    deadline = time.monotonic() + 30
    while world.relayer_sent() < len(payers):
        assert time.monotonic() < deadline, (
            [(a.status_code, a.text) for a in answers if a is not None],
            f"{world.relayer_sent()} of {len(payers)} payments broadcast while none is mined",
        )
        time.sleep(0.05)
    assert world.w3.eth.get_transaction_count(world.relayer.address, "latest") == 0
    assert [(a.status_code, a.text) for a in answers if a is not None] == []  # all waiting

    world.node.mine()
    for buyer in buyers:
        buyer.join(timeout=60)
    assert [answer.status_code if answer else None for answer in answers] == [200] * len(payers)
    for answer in answers:
        assert answer is not None and answer.headers.get("PAYMENT-RESPONSE")
    assert world.seller_balance() == len(payers) * PRICE
    assert sorted(Purchase.objects.values_list("payment_state", flat=True)) == ["paid"] * len(
        payers
    )
    # One broadcast each, recorded as the blocking wait records it.
    assert PaymentAttempt.objects.filter(state="succeeded").count() == len(payers)


def test_the_payment_id_stays_claimed_while_its_payment_waits_on_the_loop(
    make_x402_world, settings, start_asgi_server
):
    """The flow returns the wait for the block as a value with the key still claimed
    (purchases.services.checkout.flow.PaymentPending): the same payment sent again meanwhile
    is told 409 payment_in_flight, not taken over and settled a second time; once the block
    comes, the first request answers and the resent one gets that stored answer."""
    world = make_x402_world(no_mining=True, offering={"expected_run_time": timedelta(seconds=60)})
    settings.X402_NETWORKS[NETWORK]["confirmation_timeout"] = 60.0
    settings.X402_RESULT_WAIT_SECONDS = 60
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "X402_THREADS": 1}
    settings.ALLOWED_HOSTS = ["127.0.0.1"]
    url = f"{start_asgi_server()}{world.paid_url}"
    required = requests.post(url, json=INPUT, timeout=30)
    payment = sign_payment(
        required.headers["PAYMENT-REQUIRED"], world.payers[0], "x402-async-held-0001-id"
    )
    answers: list[requests.Response | None] = [None]

    def pay() -> None:
        answers[0] = requests.post(
            url, json=INPUT, headers={"PAYMENT-SIGNATURE": payment}, timeout=60
        )

    first = threading.Thread(target=pay, daemon=True)
    first.start()
    deadline = time.monotonic() + 30
    while world.relayer_sent() < 1:
        assert time.monotonic() < deadline, answers
        time.sleep(0.05)

    resent = requests.post(url, json=INPUT, headers={"PAYMENT-SIGNATURE": payment}, timeout=30)

    assert resent.status_code == 409, resent.text
    assert resent.json()["code"] == "payment_in_flight"
    assert world.relayer_sent() == 1  # the waiting payment was not taken over
    world.node.mine()
    first.join(timeout=60)
    answer = answers[0]
    assert answer is not None and answer.status_code == 200, answer and answer.text
    again = requests.post(url, json=INPUT, headers={"PAYMENT-SIGNATURE": payment}, timeout=30)
    assert (again.status_code, again.content) == (200, answer.content)
    assert world.seller_balance() == PRICE
    assert PaymentAttempt.objects.get().state == "succeeded"
