"""Rows inserted by hand (core.inserts) are the rows the ORM's bulk_create writes; a
transition's save and a lease holder's save write only what they name, conditional on the
state they read; on PostgreSQL and on the embedded SQLite alike."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, models, transaction
from django.db.models import F, Max, Value
from django.db.models.functions import Upper
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_fsm import ConcurrentTransition

from core.inserts import insert_statement_of
from fulfillment.models import ExecutionAttempt
from purchases.models import Purchase, PurchaseEvent
from tests.factories import PaymentAttemptFactory

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]


def _fields(instance: models.Model) -> dict[str, Any]:
    return {f.attname: getattr(instance, f.attname) for f in instance._meta.concrete_fields}


def test_a_transition_saved_over_a_row_moved_meanwhile_writes_nothing():
    attempt = PaymentAttemptFactory.create(purchase__payment_state=Purchase.PaymentState.PAYING)
    held = Purchase.objects.get(pk=attempt.purchase_id)
    with transaction.atomic():
        moved = Purchase.objects.select_for_update().get(pk=held.pk)
        moved.payment_pend(reason_code="not_on_chain_yet")
        moved.save(update_fields=["payment_state", "reason_code", "updated_at"])

    held.payment_fail(reason_code="transaction_reverted")
    with pytest.raises(ConcurrentTransition), transaction.atomic():
        held.save(update_fields=["payment_state", "reason_code", "updated_at"])

    stored = Purchase.objects.get(pk=held.pk)
    assert (stored.payment_state, stored.reason_code) == ("settlement_pending", "not_on_chain_yet")


def test_a_transition_save_writes_the_fields_named_and_moves_its_read_state():
    attempt = PaymentAttemptFactory.create(purchase__payment_state=Purchase.PaymentState.PAYING)
    purchase = Purchase.objects.get(pk=attempt.purchase_id)
    before = purchase.updated_at
    purchase.payer = "0x" + "11" * 20  # changed in memory, not named: not written
    purchase.payment_pend(reason_code="not_on_chain_yet")
    with transaction.atomic():
        purchase.save(update_fields=["payment_state", "reason_code", "updated_at"])
        # The next save is conditional on the state just written, not the one first read.
        purchase.payment_complete(paid_at=purchase.updated_at)
        purchase.save(update_fields=["payment_state", "paid_at", "updated_at"])

    stored = Purchase.objects.get(pk=purchase.pk)
    assert (stored.payment_state, stored.reason_code) == ("paid", "not_on_chain_yet")
    assert stored.paid_at == purchase.paid_at and stored.updated_at > before
    assert stored.payer == attempt.purchase.payer


def test_an_expression_saved_still_goes_through_the_orm():
    attempt = PaymentAttemptFactory.create(purchase__payment_state=Purchase.PaymentState.PAYING)
    purchase = Purchase.objects.get(pk=attempt.purchase_id)
    purchase.amount = F("amount") + 1
    with transaction.atomic():
        purchase.save(update_fields=["amount"])
    assert Purchase.objects.get(pk=purchase.pk).amount == attempt.purchase.amount + 1


def _events(purchase: Purchase, count: int) -> list[PurchaseEvent]:
    return [
        PurchaseEvent(
            purchase=purchase,
            subject="purchase.payment",
            from_state="unpaid",
            to_state=f"state {n}",
            actor_type=PurchaseEvent.ActorType.SYSTEM,
            evidence={"n": n, "nested": {"amount": str(n * 10)}},
        )
        for n in range(count)
    ]


def _insert_by_hand(objs: list[PurchaseEvent]) -> None:
    sql, params = insert_statement_of(objs)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def test_rows_inserted_by_hand_are_the_rows_bulk_create_writes():
    purchase = PaymentAttemptFactory.create().purchase
    for count in (1, 3):
        by_hand, by_orm = _events(purchase, count), _events(purchase, count)
        before = PurchaseEvent.objects.aggregate(last=Max("pk"))["last"] or 0
        with transaction.atomic():
            _insert_by_hand(by_hand)
            PurchaseEvent.objects.bulk_create(by_orm)
        written = list(PurchaseEvent.objects.filter(pk__gt=before).order_by("pk"))
        assert len(written) == 2 * count
        for got, want in zip(written[:count], written[count:], strict=True):
            ignored = {"id", "created_at"}
            assert {k: v for k, v in _fields(got).items() if k not in ignored} == {
                k: v for k, v in _fields(want).items() if k not in ignored
            }
        assert all(event.created_at is not None for event in by_hand)  # auto_now_add, pre-saved
        assert [e.created_at for e in written[:count]] == [e.created_at for e in by_hand]


def test_rows_only_the_orm_can_write_are_refused():
    purchase = PaymentAttemptFactory.create().purchase
    with pytest.raises(ValueError, match="cannot be written by hand"):
        insert_statement_of([PurchaseEvent(purchase=purchase, subject=Upper(Value("x")))])
    saved = PurchaseEvent.objects.create(purchase=purchase, subject="kept", actor_type="system")
    with pytest.raises(ValueError, match="cannot be written by hand"):
        insert_statement_of([saved])  # a primary key set


def _running_attempt() -> ExecutionAttempt:
    purchase = PaymentAttemptFactory.create(purchase__paid=True, purchase__prepaid=True).purchase
    now = timezone.now()
    return ExecutionAttempt.objects.create(
        purchase=purchase,
        executor="report",
        worker="first",
        lease_token="first-lease",
        lease_expires_at=now,
        job_idempotency_key=f"exec:{purchase.pk}",
        started_at=now,
    )


def test_a_lease_holder_saves_its_outcome_in_one_conditional_update():
    attempt = _running_attempt()
    held = ExecutionAttempt.held(attempt_id=attempt.pk, lease_token="first-lease", job_ref="j1")
    held.succeed(at=timezone.now())
    with CaptureQueriesContext(connection) as captured, transaction.atomic():
        held.save(update_fields=["state", "finished_at", "job_ref"])
    control = ("SAVEPOINT", "RELEASE SAVEPOINT", "BEGIN", "COMMIT")
    [update] = [q["sql"] for q in captured.captured_queries if not q["sql"].startswith(control)]
    assert update.startswith("UPDATE") and "lease_token" in update
    stored = ExecutionAttempt.objects.get(pk=attempt.pk)
    assert (stored.state, stored.job_ref, stored.finished_at) == (
        "succeeded",
        "j1",
        held.finished_at,
    )


def test_a_lease_taken_over_meanwhile_is_a_concurrent_transition_and_writes_nothing():
    attempt = _running_attempt()
    ExecutionAttempt.objects.filter(pk=attempt.pk).update(lease_token="second-lease")
    held = ExecutionAttempt.held(attempt_id=attempt.pk, lease_token="first-lease", job_ref="j1")
    held.succeed(at=timezone.now())
    with pytest.raises(ConcurrentTransition), transaction.atomic():
        held.save(update_fields=["state", "finished_at", "job_ref"])
    stored = ExecutionAttempt.objects.get(pk=attempt.pk)
    assert (stored.state, stored.job_ref, stored.finished_at) == ("running", "", None)
