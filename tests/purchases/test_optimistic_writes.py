"""The pay path writes on rows it already holds, each write conditional on the state it
read (issue 9's budgets). When another writer moved a row meanwhile, nothing of the
optimistic try is kept and the flow runs again under row locks: these tests move the row
in between and check the outcome is the one the locked path gives."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from fulfillment.executors import JobOutput
from fulfillment.models import ExecutionAttempt, Result
from payments.models import PaymentAttempt
from payments.rails import SettlementOutcome, SettlementStatus
from purchases.models import Purchase, PurchaseEvent
from purchases.services.fulfil import execution
from purchases.services.settle.settlement import settlement_record_outcome
from tests.factories import PaymentAttemptFactory

pytestmark = pytest.mark.django_db
TX = "0x" + "ab" * 32


def test_an_outcome_for_rows_moved_since_they_were_recorded_is_applied_under_their_locks():
    attempt = PaymentAttemptFactory.create(purchase__payment_state=Purchase.PaymentState.PAYING)
    held = (Purchase.objects.get(pk=attempt.purchase_id), PaymentAttempt.objects.get(pk=attempt.pk))
    # Meanwhile a look-up found it pending: both rows move on under their locks.
    with transaction.atomic():
        purchase = Purchase.objects.select_for_update().get(pk=attempt.purchase_id)
        purchase.payment_pend(reason_code="not_on_chain_yet")
        purchase.save()
        moved = PaymentAttempt.objects.select_for_update().get(pk=attempt.pk)
        moved.pend(tx_hash=TX)
        moved.save()

    recorded_purchase, recorded_attempt = settlement_record_outcome(
        attempt_id=attempt.pk,
        purchase_id=attempt.purchase_id,
        outcome=SettlementOutcome(SettlementStatus.CONFIRMED, TX, block_number=7),
        now=held[0].created_at,
        known=held,
    )

    purchase = Purchase.objects.get(pk=attempt.purchase_id)
    assert purchase.payment_state == Purchase.PaymentState.PAID
    assert purchase.fulfillment_state == Purchase.FulfillmentState.QUEUED
    assert PaymentAttempt.objects.get(pk=attempt.pk).state == PaymentAttempt.State.SUCCEEDED
    assert (recorded_purchase.payment_state, recorded_attempt.block_number) == ("paid", 7)
    moves = PurchaseEvent.objects.filter(purchase=purchase, subject="purchase.payment")
    # From the state it was really in; the optimistic try (from paying) left nothing.
    assert list(moves.values_list("from_state", "to_state")) == [("settlement_pending", "paid")]


def test_work_that_finishes_after_its_purchase_was_given_up_stores_nothing():
    attempt = PaymentAttemptFactory.create(
        purchase__paid=True, purchase__prepaid=True, succeeded=True, rail="prepaid"
    )
    claimed = execution._claim(attempt.purchase_id, "w1")
    assert claimed is not None and claimed.purchase.payment_state == Purchase.PaymentState.PAID
    # Meanwhile the sweeper gave the execution up (effect unknown): the purchase moved.
    execution.purchase_execution_give_up(
        purchase_id=attempt.purchase_id, worker="sweeper", reason_code="job_still_running"
    )

    outcome = execution._succeed(claimed, JobOutput(b"{}", "application/json"), "job-1").outcome

    assert outcome == execution.ExecutionOutcome.LEASE_LOST
    assert not Result.objects.filter(purchase_id=attempt.purchase_id).exists()
    purchase = Purchase.objects.get(pk=attempt.purchase_id)
    assert purchase.fulfillment_state == Purchase.FulfillmentState.UNKNOWN
    assert ExecutionAttempt.objects.get().state == ExecutionAttempt.State.UNKNOWN


def test_work_on_a_purchase_claimed_paid_succeeds_without_reading_it_again(
    django_assert_max_num_queries,
):
    attempt = PaymentAttemptFactory.create(
        purchase__paid=True, purchase__prepaid=True, succeeded=True, rail="prepaid"
    )
    claimed = execution._claim(attempt.purchase_id, "w1")
    assert claimed is not None
    output = JobOutput(b'{"ok": true}', "application/json")
    # A SAVEPOINT pair (inside the test's transaction), then only writes: the purchase's
    # UPDATE, the attempt's, the result's INSERT (its receipt in the same statement on
    # PostgreSQL; a statement of its own on SQLite, which has no data-modifying CTE) and
    # the events' INSERT. No read.
    with django_assert_max_num_queries(6 if connection.vendor == "postgresql" else 7):
        executed = execution._succeed(claimed, output, "job-1")
        assert executed.outcome == execution.ExecutionOutcome.SUCCEEDED
    purchase = Purchase.objects.select_related("result", "receipt").get(pk=attempt.purchase_id)
    assert purchase.fulfillment_state == Purchase.FulfillmentState.SUCCEEDED
    assert bytes(purchase.result.body) == output.content
    assert purchase.receipt.transaction == attempt.tx_hash
    assert ExecutionAttempt.objects.get().job_ref == "job-1"
    # The run hands back the purchase as it wrote it, with the result and receipt it stored:
    # an answer delivering them (the paid request that ran the work inline) reads nothing.
    kept = executed.purchase
    assert kept is not None and kept.fulfillment_state == Purchase.FulfillmentState.SUCCEEDED
    with django_assert_max_num_queries(0):
        assert (kept.result.pk, bytes(kept.result.body)) == (purchase.result.pk, output.content)
        assert kept.receipt.public_id == purchase.receipt.public_id
        assert kept.receipt.signed == purchase.receipt.signed
