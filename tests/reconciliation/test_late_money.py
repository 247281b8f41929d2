"""Money that lands late or twice becomes one refund-owed record and one alert."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from rest_framework.test import APIClient
from x402.http.utils import decode_payment_signature_header

from devtools.test_token import send_transfer_with_authorization
from payments.models import Refund
from purchases.models import Offering, Purchase, Quote
from purchases.services.jobs import housekeeping, reconcile
from tests.x402.e2e import PRICE, ask, sign_payment


def _failed(world, double, payment_id="late-money-id-00000001"):
    """The facilitator rejects the payment (proven, pre-broadcast): the purchase failed."""
    client = APIClient()
    double.mode = "reject"
    header = ask(client, world)["PAYMENT-REQUIRED"]
    payment = sign_payment(header, world.payers[0], payment_id)
    refused = ask(client, world, payment=payment)
    assert refused.status_code == 402 and refused.json()["code"] == "payment_failed"
    assert Purchase.objects.get().payment_state == "failed"
    return client, header, payment


def _lands_anyway(world, payment):
    """...yet someone broadcasts that same signed authorization and it lands."""
    signed = decode_payment_signature_header(payment).payload
    sent = send_transfer_with_authorization(
        world.w3, world.token, world.deployer, signed["authorization"], signed["signature"]
    )
    # anvil's automine mines after eth_sendRawTransaction has answered, and on the session
    # node, grown by the suite's earlier tests, that lag reaches a second: wait for the receipt.
    receipt = world.w3.eth.wait_for_transaction_receipt(sent, timeout=30)
    assert receipt["status"] == 1, f"the late transfer reverted: {receipt}"


def _failed_then_landed(world, double):
    client, _header, payment = _failed(world, double)
    _lands_anyway(world, payment)
    assert world.seller_balance() == PRICE
    return client


@pytest.fixture
def facilitated(make_facilitated_world):
    return make_facilitated_world()


@pytest.mark.django_db
def test_late_transfer_after_failure_is_one_refund_owed_and_one_alert(
    settings, facilitated, webhook
):
    settings.TOLLBOOTH_ALERT_WEBHOOK_URL = webhook.url
    world, double = facilitated
    _failed_then_landed(world, double)
    for _ in range(2):  # beat runs it again: nothing new
        reconcile.watch_failed_attempts()
        housekeeping.send_pending_alerts()
    refund = Refund.objects.get()
    assert (refund.reason_code, refund.method, refund.state) == (
        "late_settlement",
        "pay_back",
        "owed",
    )
    assert refund.amount == PRICE and refund.transaction.startswith("0x")
    assert refund.purchase == Purchase.objects.get()
    assert Purchase.objects.get().payment_state == "failed"  # the recorded outcome stands
    assert len(webhook.received) == 1
    assert webhook.received[0].headers["Idempotency-Key"] == f"tollbooth-refund-{refund.pk}"


@pytest.mark.django_db
def test_late_transfer_is_fulfilled_when_the_offering_says_so_and_stock_is_free(
    settings, facilitated
):
    world, double = facilitated
    Offering.objects.filter(pk=world.offering.pk).update(late_payment_policy="fulfil")
    _failed_then_landed(world, double)
    reconcile.watch_failed_attempts()
    purchase = Purchase.objects.get()
    assert (purchase.payment_state, purchase.fulfillment_state) == ("paid", "queued")
    assert not Refund.objects.exists()


@pytest.mark.django_db
def test_released_stock_is_never_resurrected(settings, facilitated):
    world, double = facilitated
    Offering.objects.filter(pk=world.offering.pk).update(late_payment_policy="fulfil", stock=1)
    _client, _header, payment = _failed(world, double)
    # The failed purchase's unit went back on sale and someone else bought it.
    Quote.objects.update(holds_stock=False)
    _lands_anyway(world, payment)
    reconcile.watch_failed_attempts()
    assert Purchase.objects.get().payment_state == "failed"
    assert Refund.objects.get().reason_code == "late_settlement"
    assert Offering.objects.get(pk=world.offering.pk).stock == 0


@pytest.mark.django_db(transaction=True)
def test_duplicate_settlement_once_even_with_two_runs_at_once(settings, facilitated, webhook):
    settings.TOLLBOOTH_ALERT_WEBHOOK_URL = webhook.url
    world, double = facilitated
    client, header, first = _failed(world, double)
    double.mode = "ok"  # the buyer pays the same quote again, new authorization, new id: paid
    second = ask(
        client, world, payment=sign_payment(header, world.payers[1], "late-money-second-0001")
    )
    assert second.status_code in (200, 202), second.content
    assert Purchase.objects.get().payment_state == "paid"
    # The double answers /settle only once it holds the receipt: paid means mined.
    assert world.seller_balance() == PRICE  # the second payment's transfer
    _lands_anyway(world, first)  # and then the first authorization lands too
    assert world.seller_balance() == 2 * PRICE
    barrier = threading.Barrier(2)

    def run() -> None:
        barrier.wait()
        try:
            reconcile.watch_failed_attempts()
            housekeeping.send_pending_alerts()
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    refund = Refund.objects.get()
    assert (refund.reason_code, refund.state, refund.amount) == (
        "duplicate_settlement",
        "owed",
        PRICE,
    )
    assert len(webhook.received) == 1


@pytest.mark.django_db
def test_failed_becomes_void_only_once_every_authorization_is_unusable(settings, facilitated):
    from datetime import timedelta

    from django.utils import timezone

    world, double = facilitated
    Offering.objects.filter(pk=world.offering.pk).update(stock=5)
    _failed(world, double)  # held one unit; its authorization is valid for ten more minutes
    assert Offering.objects.get(pk=world.offering.pk).stock == 4
    # The failure is a day old, but the authorization could still land: not final yet.
    Purchase.objects.update(updated_at=timezone.now() - timedelta(hours=25))
    stats = reconcile.finalize_failed_purchases(now=timezone.now())
    assert (stats["voided"], stats["not_yet_final"]) == (0, 1)
    assert Purchase.objects.get().payment_state == "failed"
    # Once its window has closed, nothing it received can ever land: void, stock released.
    window = Purchase.objects.get().payment_attempts.get().valid_before_at
    stats = reconcile.finalize_failed_purchases(now=window + timedelta(seconds=1))
    assert stats["voided"] == 1
    purchase = Purchase.objects.get()
    assert (purchase.payment_state, purchase.reason_code) == ("void", "authorizations_unusable")
    assert Offering.objects.get(pk=world.offering.pk).stock == 5  # its unit is for sale again
