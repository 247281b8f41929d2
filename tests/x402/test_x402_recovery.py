"""Timeouts, races, dropped transactions and facilitator faults: never pay twice, never
serve unpaid work, never need a second signature. Balances are read on chain."""

from __future__ import annotations

from datetime import timedelta

import pytest
import requests
from rest_framework.test import APIClient

from fulfillment.models import Result
from payments.models import PaymentAttempt
from purchases.models import Offering, Purchase
from purchases.services.fulfil.execution import purchase_execute
from tests.integration.helpers import race
from tests.x402.e2e import PRICE, ask, sign_payment

# Also run on the embedded SQLite default (`make test`'s second pass): `make demo` serves this.
pytestmark = pytest.mark.embedded

PAY_ID = "x402-recovery-id-000001"


# Asked and paid with the same input, as clients retry (an anonymous quote's input comes
# back with its payment: docs/x402.md, stateless anonymous quotes).
INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\n"}


def _post(base: str, world, payment: str) -> tuple[int, dict]:
    response = requests.post(
        f"{base}{world.paid_url}",
        json=INPUT,
        headers={"PAYMENT-SIGNATURE": payment},
        timeout=60,
    )
    return response.status_code, response.json()


@pytest.mark.sqlite_concurrency
def test_eight_parallel_requests_with_one_payment_id_transfer_once(x402_live_world, http_server):
    world = x402_live_world
    required = requests.post(f"{http_server}{world.paid_url}", json=INPUT, timeout=10)
    payment = sign_payment(required.headers["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    answers = race(8, lambda i: _post(http_server, world, payment))
    statuses = [status for status, _ in answers]
    assert set(statuses) <= {202, 409}, answers
    assert all(body["code"] == "payment_in_flight" for status, body in answers if status == 409)
    assert world.seller_balance() == PRICE
    assert world.relayer_sent() == 1
    assert PaymentAttempt.objects.count() == 1


@pytest.mark.sqlite_concurrency
def test_different_payment_ids_on_one_quote_transfer_once(x402_live_world, http_server):
    world = x402_live_world
    # Window off: every other payment is refused as quote_already_paid, not answered as a
    # duplicate of the first (tests/x402/test_duplicates.py covers the window).
    Offering.objects.update(duplicate_window=timedelta(0))
    required = requests.post(f"{http_server}{world.paid_url}", json=INPUT, timeout=10)
    header = required.headers["PAYMENT-REQUIRED"]
    payments = [
        sign_payment(header, world.payers[i % 3], f"x402-distinct-id-{i:06d}") for i in range(8)
    ]
    answers = race(8, lambda i: _post(http_server, world, payments[i]))
    accepted = [body for status, body in answers if status == 202]
    refused = [body for status, body in answers if status == 402]
    assert len(accepted) == 1 and len(refused) == 7, answers
    assert {body["code"] for body in refused} == {"quote_already_paid"}
    assert world.seller_balance() == PRICE
    assert world.relayer_sent() == 1


def test_paused_mining_answers_pending_then_the_result_without_a_new_signature(x402_paused_world):
    world, client = x402_paused_world, APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    pending = ask(client, world, payment=payment)
    assert pending.status_code == 202
    body = pending.json()
    attempt = PaymentAttempt.objects.get()
    assert body["status"] == "settlement_pending"
    assert body["transaction"] == attempt.tx_hash and attempt.tx_hash
    assert int(pending["Retry-After"]) >= 1
    assert Purchase.objects.get().payment_state == "settlement_pending"
    assert not Result.objects.exists() and world.seller_balance() == 0

    world.node.mine()
    paid = ask(client, world, payment=payment)  # the same signed payment: polling
    assert paid.status_code == 202 and paid.json()["payment"]["state"] == "paid"
    purchase_execute(purchase_id=Purchase.objects.get().pk, worker="test")
    result = ask(client, world, payment=payment)
    assert result.status_code == 200
    assert world.seller_balance() == PRICE
    assert world.relayer_sent() == 1  # one transaction, ever


def test_dropped_transaction_is_rebroadcast_identically_on_the_next_poll(x402_paused_world):
    world, client = x402_paused_world, APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    assert ask(client, world, payment=payment).status_code == 202
    attempt = PaymentAttempt.objects.get()
    world.node.drop_transaction(attempt.tx_hash)
    assert world.w3.eth.get_transaction_count(world.relayer.address, "pending") == 0

    # The buyer's next poll finds it gone and sends the same bytes at once (the first
    # broadcast has answered, so no backoff holds the first resubmission).
    still_pending = ask(client, world, payment=payment)
    assert still_pending.status_code == 202
    assert still_pending.json()["transaction"] == attempt.tx_hash  # same hash: same transaction
    world.node.mine()
    assert ask(client, world, payment=payment).json()["payment"]["state"] == "paid"
    assert world.seller_balance() == PRICE
    attempt.refresh_from_db()
    assert (attempt.state, attempt.relayer_nonce) == ("succeeded", 0)


FAULTS = [
    "hang",
    "html_502",
    "success_503",
    "truncated",
    "settlement_pending",
    "settlement_pending_500",
    "invalid_transaction_state",
]


@pytest.mark.parametrize("mode", FAULTS)
def test_facilitator_faults_leave_the_purchase_pending_and_settle_at_most_once(
    make_facilitated_world, db, mode
):
    world, double = make_facilitated_world(mode=mode, hang_seconds=3.0)
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    answer = ask(client, world, payment=payment)
    assert answer.status_code == 202, answer.content  # never the result, never a fresh 402
    assert answer.json()["status"] == "settlement_pending"
    purchase = Purchase.objects.get()
    assert purchase.payment_state == "settlement_pending"
    assert not Result.objects.exists()
    assert double.calls["settle"] == 1
    assert world.seller_balance() == PRICE * double.broadcast_count  # 0 or 1, never 2
    if mode in ("success_503", "settlement_pending", "settlement_pending_500"):  # hash named
        assert PaymentAttempt.objects.get().tx_hash == double.broadcasts[0].lower()

    # Polling with the same payment id reconciles on chain: what reached it is never sent
    # again; what never did is resubmitted (the same payload) once, at once.
    again = ask(client, world, payment=payment)
    purchase.refresh_from_db()
    if double.broadcast_count:
        assert double.calls["settle"] == 1
        assert again.status_code == 202 and purchase.payment_state == "paid"
    else:
        assert double.calls["settle"] == 2 and double.broadcast_count == 0
        assert purchase.payment_state == "settlement_pending"
    assert world.seller_balance() == PRICE * double.broadcast_count


def test_verified_delivery_runs_and_delivers_before_settlement_confirms(make_x402_world, db):
    world = make_x402_world(no_mining=True, offering={"delivery_condition": "verified"})
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    pending = ask(client, world, payment=payment)
    purchase = Purchase.objects.get()
    assert purchase.payment_state == "settlement_pending"
    assert purchase.fulfillment_state == "queued"  # verification was enough to start
    assert pending.status_code == 202
    purchase_execute(purchase_id=purchase.pk, worker="test")
    delivered = ask(client, world, payment=payment)
    assert delivered.status_code == 200
    assert Purchase.objects.get().payment_state == "settlement_pending"


def test_spend_cap_binds_the_paying_wallets_owner_on_x402(make_x402_world, db, buyer):
    from purchases.models import BuyerWallet

    world = make_x402_world()
    buyer.spend_cap = PRICE - 1
    buyer.save()
    BuyerWallet.objects.create(buyer=buyer, address=world.payers[0].address.lower())
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], PAY_ID)
    refused = ask(client, world, payment=payment)
    assert refused.status_code == 402
    assert refused.json()["code"] == "spend_cap_exceeded"
    assert world.relayer_sent() == 0 and not Purchase.objects.exists()
