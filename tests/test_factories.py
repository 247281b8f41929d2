"""Each factory trait builds a row, saved, in the state it names (FSM fields are protected)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from tests.factories import (
    EscalationFactory,
    PaymentAttemptFactory,
    PurchaseFactory,
    QuoteFactory,
    RefundFactory,
)

pytestmark = pytest.mark.django_db
FAILED = "settlement_failed"


@pytest.mark.parametrize(
    ("factory", "trait", "fields"),
    [
        (QuoteFactory, None, {"state": "open"}),
        (QuoteFactory, "accepted", {"state": "accepted"}),
        (QuoteFactory, "expired", {"state": "expired"}),
        (PurchaseFactory, None, {"payment_state": "unpaid", "fulfillment_state": "not_started"}),
        (PurchaseFactory, "settlement_pending", {"payment_state": "settlement_pending"}),
        (PurchaseFactory, "paid", {"payment_state": "paid", "fulfillment_state": "queued"}),
        (PurchaseFactory, "failed", {"payment_state": "failed", "reason_code": FAILED}),
        (PurchaseFactory, "executed", {"payment_state": "paid", "fulfillment_state": "succeeded"}),
        (PurchaseFactory, "prepaid", {"rail": "prepaid", "payment_state": "unpaid"}),
        (PaymentAttemptFactory, None, {"state": "recorded", "tx_hash": None}),
        (PaymentAttemptFactory, "pending", {"state": "settlement_pending"}),
        (PaymentAttemptFactory, "succeeded", {"state": "succeeded"}),
        (PaymentAttemptFactory, "failed", {"state": "failed"}),
        (RefundFactory, None, {"state": "owed", "paid_at": None}),
        (RefundFactory, "paid", {"state": "paid", "paid_by": "finance"}),
        (EscalationFactory, None, {"state": "open", "resolved_at": None}),
        (EscalationFactory, "resolved", {"state": "resolved", "resolved_by": "support"}),
    ],
)
def test_each_trait_saves_the_state_it_names(factory, trait, fields):
    row = factory.create(**({trait: True} if trait else {}))
    row.refresh_from_db()
    assert {name: getattr(row, name) for name in fields} == fields


def test_related_rows_agree_with_what_they_pay_for():
    refund = RefundFactory.create()
    attempt, purchase = refund.payment_attempt, refund.purchase
    assert attempt.purchase == purchase and purchase.quote.state == "accepted"
    assert refund.amount == attempt.amount == purchase.amount == purchase.quote.price
    assert attempt.state == "succeeded" and attempt.tx_hash
    paid_at = PurchaseFactory.create(paid=True).paid_at
    assert paid_at is not None and paid_at <= timezone.now()
