"""Reconciliation jobs on real PostgreSQL and a real anvil chain. Time is injected: every
job takes `now`, and the chain's own clock is moved with evm_increaseTime."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from payments.models import LedgerEntry, PaymentAttempt
from purchases.models import Escalation, JobRun, Offering, Purchase, PurchaseEvent, Quote
from purchases.services.jobs import housekeeping, reconcile
from purchases.services.quote.quotes import quote_create
from tests.conftest import CSV_INPUT
from tests.x402.e2e import PRICE, ask, sign_payment

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]
PAY_ID = "reconcile-payment-0000001"
LATER = timedelta(minutes=3)  # past the request's own settlement grace


def pending_purchase(world, payment_id=PAY_ID, **signing):
    client = APIClient()
    payment = sign_payment(
        ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], payment_id, **signing
    )
    answer = ask(client, world, payment=payment)
    assert answer.status_code == 202, answer.content
    return Purchase.objects.get(), payment


@pytest.fixture
def paused(make_x402_world, db):
    return make_x402_world(no_mining=True)


def test_confirmed_later_is_settled_and_queued(paused):
    purchase, _ = pending_purchase(paused)
    paused.node.mine()
    stats = reconcile.reconcile_pending_settlements(now=timezone.now() + LATER)
    purchase = Purchase.objects.get(pk=purchase.pk)
    assert (purchase.payment_state, purchase.fulfillment_state) == ("paid", "queued")
    assert stats["confirmed"] == 1
    assert paused.seller_balance() == PRICE
    run = JobRun.objects.get(job="pending_settlements")
    assert run.finished_at and run.stats["confirmed"] == 1


def test_dropped_transaction_is_rebroadcast_identically(paused):
    purchase, _ = pending_purchase(paused)
    attempt = PaymentAttempt.objects.get()
    paused.node.drop_transaction(attempt.tx_hash)
    reconcile.reconcile_pending_settlements(now=timezone.now() + LATER)
    assert paused.w3.eth.get_transaction(attempt.tx_hash)  # the same hash is back in the pool
    paused.node.mine()
    reconcile.reconcile_pending_settlements(now=timezone.now() + LATER + timedelta(minutes=1))
    assert Purchase.objects.get(pk=purchase.pk).payment_state == "paid"
    assert paused.seller_balance() == PRICE
    assert paused.relayer_sent() == 1


def test_window_closed_with_the_nonce_unused_fails_for_good(paused):
    import time as wall

    purchase, _ = pending_purchase(paused, valid_before=int(wall.time()) + 45)
    attempt = PaymentAttempt.objects.get()
    paused.node.drop_transaction(attempt.tx_hash)
    paused.node.increase_time(120)
    paused.node.mine()
    reconcile.reconcile_pending_settlements(now=timezone.now() + timedelta(minutes=2))
    attempt.refresh_from_db()
    assert (attempt.state, attempt.reason_code) == ("failed", "authorization_expired_unused")
    purchase = Purchase.objects.get(pk=purchase.pk)
    assert (purchase.payment_state, purchase.reason_code) == (
        "failed",
        "authorization_expired_unused",
    )
    assert paused.seller_balance() == 0


def test_chain_down_backs_off_then_escalates_to_reconciliation_then_support(
    paused, settings, webhook
):
    purchase, _ = pending_purchase(paused)
    settings.X402_NETWORKS["eip155:31337"]["rpc_url"] = "http://127.0.0.1:9"  # nothing listens
    start = timezone.now() + LATER
    attempt = PaymentAttempt.objects.get()
    delays = []
    now = start
    for _ in range(4):
        reconcile.reconcile_pending_settlements(now=now)
        attempt.refresh_from_db()
        delays.append(attempt.next_check_at - now)
        now = attempt.next_check_at
    assert delays == [
        timedelta(seconds=30),
        timedelta(minutes=2),
        timedelta(minutes=10),
        timedelta(hours=1),
    ]
    assert not Escalation.objects.exists()
    reconcile.reconcile_pending_settlements(now=start + timedelta(hours=7))
    assert Escalation.objects.get().owner == "reconciliation"
    reconcile.reconcile_pending_settlements(now=start + timedelta(hours=30))
    assert set(Escalation.objects.values_list("owner", flat=True)) == {"reconciliation", "support"}
    # Never "failed": nothing proved it.
    assert Purchase.objects.get(pk=purchase.pk).payment_state == "settlement_pending"
    # Each owner is told once, however often the alert sweeper runs.
    settings.TOLLBOOTH_ALERT_WEBHOOK_URL = webhook.url
    settings.ADMINS = [("ops", "ops@example.invalid")]
    for _ in range(2):
        housekeeping.send_pending_alerts()
    keys = sorted(r.headers["Idempotency-Key"] for r in webhook.received)
    assert keys == sorted(f"tollbooth-escalation-{e.pk}" for e in Escalation.objects.all())


def test_expired_quotes_release_their_stock(buyer, offering):
    Offering.objects.filter(pk=offering.pk).update(stock=3)
    for title in ("a", "b"):
        quote_create(
            buyer=buyer, offering_slug=offering.slug, raw_input={**CSV_INPUT, "title": title}
        )
    assert Offering.objects.get(pk=offering.pk).stock == 1
    stats = housekeeping.expire_quotes(now=timezone.now() + timedelta(minutes=16))
    assert stats["expired"] == 2
    assert Offering.objects.get(pk=offering.pk).stock == 3
    assert set(Quote.objects.values_list("state", flat=True)) == {"expired"}
    assert housekeeping.expire_quotes(now=timezone.now() + timedelta(minutes=17))["expired"] == 0


def test_a_payment_id_past_retention_is_answered_with_the_receipt(
    client_for_buyer, buyer, offering
):
    from purchases.services.fulfil.execution import purchase_execute

    quote = client_for_buyer.post(
        "/api/v1/quotes", {"offering": offering.slug, "input": CSV_INPUT}, format="json"
    ).json()["id"]
    key = "retained-key-0000000001"
    ref = client_for_buyer.post(
        f"/api/v1/quotes/{quote}/purchase",
        {"rail": "prepaid"},
        format="json",
        HTTP_IDEMPOTENCY_KEY=key,
    ).json()["purchase"]
    purchase_execute(purchase_id=Purchase.objects.get(ref=ref).pk, worker="test")
    assert (
        housekeeping.compact_payment_ids(now=timezone.now() + timedelta(hours=25))["compacted"] == 1
    )
    weeks_later = client_for_buyer.post(
        f"/api/v1/quotes/{quote}/purchase",
        {"rail": "prepaid"},
        format="json",
        HTTP_IDEMPOTENCY_KEY=key,
    )
    assert weeks_later.status_code == 410
    body = weeks_later.json()
    assert (body["code"], body["purchase"]) == ("retention_expired", ref)
    assert body["receipt"].startswith("/api/v1/receipts/rcp_")
    assert LedgerEntry.objects.filter(buyer=buyer, kind="purchase_debit").count() == 1
    assert Purchase.objects.filter(quote__public_id=quote).count() == 1  # never a new sale
    from purchases.models import IdempotencyRecord

    assert not IdempotencyRecord.objects.filter(key=key).exists()  # only its hash is kept


@pytest.mark.django_db(transaction=True)
def test_two_runs_at_once_never_transition_twice(make_x402_world):
    world = make_x402_world(no_mining=True)
    node = world.node
    for i in range(6):
        client = APIClient()
        header = ask(client, world, {"title": f"t{i}", "csv": "a\n1\n"})["PAYMENT-REQUIRED"]
        payment = sign_payment(header, world.payers[i % 3], f"concurrent-run-{i:08d}")
        assert (
            ask(client, world, {"title": f"t{i}", "csv": "a\n1\n"}, payment=payment).status_code
            == 202
        )
    node.mine()
    barrier = threading.Barrier(2)
    results = []

    def run() -> None:
        barrier.wait()
        try:
            results.append(reconcile.reconcile_pending_settlements(now=timezone.now() + LATER))
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sum(stats["confirmed"] for stats in results) == 6
    assert sum(stats["claimed"] for stats in results) == 6
    paid_events = PurchaseEvent.objects.filter(subject="purchase.payment", to_state="paid")
    assert paid_events.count() == 6  # one transition per purchase, not two
    assert world.seller_balance() == 6 * PRICE


def test_a_nonce_lost_in_a_crash_is_filled_so_later_settlements_mine(paused):
    from payments.rails.x402.networks import network_config
    from payments.rails.x402.relayer import relayer_nonce_allocate

    # A process allocated nonce 0, then died before signing or recording anything.
    network = network_config("eip155:31337")
    assert (
        relayer_nonce_allocate(
            network=network, address=paused.relayer.address, chain_pending_nonce=0
        )
        == 0
    )
    purchase, _ = pending_purchase(paused)  # its transaction got nonce 1: stuck behind the gap
    paused.node.mine()
    assert reconcile.reconcile_pending_settlements(now=timezone.now() + LATER)["still_pending"] == 1

    stats = reconcile.heal_relayers(now=timezone.now() + timedelta(minutes=5))
    assert stats["eip155:31337:gap_filled"] == 1
    paused.node.mine()
    reconcile.reconcile_pending_settlements(now=timezone.now() + timedelta(minutes=10))
    assert Purchase.objects.get(pk=purchase.pk).payment_state == "paid"
    assert paused.seller_balance() == PRICE


def test_nonce_used_by_another_transfer_fails_the_payment_and_links_that_transaction(paused):
    from devtools.test_token import send_transfer_with_authorization, sign_transfer_authorization

    purchase, _ = pending_purchase(paused)
    attempt = PaymentAttempt.objects.get()
    paused.node.drop_transaction(attempt.tx_hash)
    # The buyer's wallet signs the same nonce over to someone else, and that lands first.
    other = sign_transfer_authorization(
        paused.payers[0],
        token_address=paused.token,
        chain_id=31337,
        name="USDC",
        version="2",
        to=paused.deployer.address,
        value=1,
        valid_after=0,
        valid_before=int(timezone.now().timestamp()) + 600,
        nonce=bytes.fromhex(attempt.authorization_nonce[2:]),
    )
    used_by = send_transfer_with_authorization(
        paused.w3, paused.token, paused.deployer, other["authorization"], other["signature"]
    )
    paused.node.mine()
    reconcile.reconcile_pending_settlements(now=timezone.now() + LATER)
    attempt.refresh_from_db()
    assert (attempt.state, attempt.reason_code) == ("failed", "authorization_used_elsewhere")
    assert Purchase.objects.get(pk=purchase.pk).payment_state == "failed"
    event = PurchaseEvent.objects.filter(subject="payment_attempt", to_state="failed").get()
    assert used_by.lower() in str(event.evidence).lower()  # the transaction that used it is linked
    assert paused.seller_balance() == 0
