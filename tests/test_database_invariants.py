"""The invariants that matter are database constraints: a bug in code cannot break them."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from fulfillment.models import ExecutionAttempt
from payments.models import LedgerEntry, PaymentAttempt
from purchases.models import Purchase, PurchaseEvent
from purchases.services.quote.quotes import quote_create
from tests.conftest import CSV_INPUT
from tests.factories import PaymentAttemptFactory

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]


@pytest.fixture
def purchase(buyer, offering) -> Purchase:
    quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=CSV_INPUT).quote
    return Purchase.objects.create(
        quote=quote,
        offering=offering,
        buyer=buyer,
        amount=quote.price,
        asset=quote.asset,
        network=quote.network,
        rail="prepaid",
    )


def attempt(purchase: Purchase, payment_id: str, **extra) -> PaymentAttempt:
    # One network for all: the tx hash constraint is per network, whatever the purchase says.
    return PaymentAttemptFactory.create(
        purchase=purchase, payment_id=payment_id, network="eip155:31337", **extra
    )


def test_one_purchase_per_quote(purchase):
    with pytest.raises(IntegrityError), transaction.atomic():
        Purchase.objects.create(
            quote=purchase.quote,
            offering=purchase.offering,
            amount=1,
            asset="a",
            network="n",
            rail="prepaid",
        )


def test_one_live_payment_attempt_per_purchase(purchase):
    attempt(purchase, "id-one-aaaaaaaaaaaa")
    with pytest.raises(IntegrityError), transaction.atomic():
        attempt(purchase, "id-two-bbbbbbbbbbbb")


def test_a_failed_attempt_does_not_block_a_new_one(purchase):
    first = attempt(purchase, "id-one-aaaaaaaaaaaa")
    first.fail(reason_code="authorization_expired_unused")
    first.save()
    attempt(purchase, "id-two-bbbbbbbbbbbb")
    assert PaymentAttempt.objects.filter(purchase=purchase).count() == 2


def test_unique_payment_id_per_scope_and_tx_hash_per_network(purchase, buyer, offering):
    attempt(purchase, "id-one-aaaaaaaaaaaa", tx_hash="0x01")
    other_quote = quote_create(
        buyer=buyer, offering_slug=offering.slug, raw_input={**CSV_INPUT, "title": "x"}
    ).quote
    other = Purchase.objects.create(
        quote=other_quote,
        offering=offering,
        buyer=buyer,
        amount=1,
        asset="a",
        network="n",
        rail="x402",
    )
    with pytest.raises(IntegrityError), transaction.atomic():
        attempt(other, "id-one-aaaaaaaaaaaa")
    with pytest.raises(IntegrityError), transaction.atomic():
        attempt(other, "id-two-bbbbbbbbbbbb", tx_hash="0x01")


def test_one_live_execution_per_purchase(purchase):
    now = timezone.now()
    fields = {
        "purchase": purchase,
        "executor": "report",
        "worker": "w",
        "lease_token": "t",
        "lease_expires_at": now + timedelta(seconds=30),
        "job_idempotency_key": "k",
        "started_at": now,
    }
    ExecutionAttempt.objects.create(**fields)
    with pytest.raises(IntegrityError), transaction.atomic():
        ExecutionAttempt.objects.create(**fields)


def test_events_and_ledger_refuse_updates_and_deletes_in_the_database(purchase, buyer):
    event = PurchaseEvent.objects.filter(quote=purchase.quote).first()
    assert event is not None
    with pytest.raises(IntegrityError, match="append-only"), transaction.atomic():
        PurchaseEvent.objects.filter(pk=event.pk).update(reason_code="rewritten")
    with pytest.raises(IntegrityError, match="append-only"), transaction.atomic():
        PurchaseEvent.objects.filter(pk=event.pk).delete()
    entry = LedgerEntry.objects.filter(buyer=buyer).get()
    with pytest.raises(IntegrityError, match="append-only"), transaction.atomic():
        LedgerEntry.objects.filter(pk=entry.pk).update(amount=10**12)


def test_state_fields_are_protected_from_direct_writes(purchase):
    with pytest.raises(AttributeError):
        purchase.payment_state = Purchase.PaymentState.PAID
