"""Queries compiled once per process (core.prepared) read and write exactly as the ORM does,
on PostgreSQL and on the embedded SQLite alike."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from django.db import connection, models, transaction
from django.db.models import F, Max, Value
from django.db.models.functions import Upper
from django.db.transaction import TransactionManagementError
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_fsm import ConcurrentTransition

from core.prepared import PreparedQuery, PreparedRaw, PreparedUpdate
from core.prepared.inserts import insert_rows, insert_statement_of
from fulfillment.models import ExecutionAttempt
from payments import selectors as payment_selectors
from purchases.models import Purchase, PurchaseEvent
from tests.factories import PaymentAttemptFactory

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]


def _locked_purchase(pk: int) -> models.QuerySet[Purchase]:
    return (
        Purchase.objects.select_for_update(of=("self",))
        .select_related("offering", "quote")
        .annotate(**payment_selectors.payment_evidence_of_purchase())
        .filter(pk=pk)
    )


LOCKED_PURCHASE = PreparedQuery(_locked_purchase, pk=int)


def _fields(instance: models.Model) -> dict[str, Any]:
    return {f.attname: getattr(instance, f.attname) for f in instance._meta.concrete_fields}


def test_a_prepared_read_makes_the_instances_the_orm_makes():
    attempt = PaymentAttemptFactory.create(
        purchase__paid=True, purchase__prepaid=True, succeeded=True, rail="prepaid"
    )
    other = PaymentAttemptFactory.create(purchase__payment_state=Purchase.PaymentState.PAYING)
    for purchase_id in (attempt.purchase_id, other.purchase_id, attempt.purchase_id):
        with transaction.atomic():
            expected = _locked_purchase(purchase_id).get()
            found = LOCKED_PURCHASE.get(pk=purchase_id)
        assert _fields(found) == _fields(expected)  # datetimes, JSON, states converted alike
        assert _fields(found.offering) == _fields(expected.offering)
        assert _fields(found.quote) == _fields(expected.quote)
        assert found.quote.canonical_input == expected.quote.canonical_input
        evidence = ("payment_reference", "payment_network")  # annotated
        assert [getattr(found, name) for name in evidence] == [
            getattr(expected, name) for name in evidence
        ]
        assert found._state.adding is False and found._state.db == "default"
    with transaction.atomic(), pytest.raises(Purchase.DoesNotExist):
        LOCKED_PURCHASE.get(pk=-1)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_prepared_locking_read_refuses_to_run_outside_a_transaction():
    attempt = PaymentAttemptFactory.create()
    with pytest.raises(TransactionManagementError):
        LOCKED_PURCHASE.get(pk=attempt.purchase_id)


def test_a_parameter_the_orm_transforms_is_refused_when_compiled():
    by_payer = PreparedQuery(
        lambda payer: Purchase.objects.filter(payer__icontains=payer), payer=str
    )
    with pytest.raises(ValueError, match="payer"):
        by_payer.fetch(payer="0xabc")


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


def _purchase_with_ref_sql(vendor: str) -> str:
    # Every column, and one no field has (offering_slug).
    return (
        "SELECT p.*, o.slug AS offering_slug"
        " FROM purchases_purchase p JOIN purchases_offering o ON o.id = p.offering_id"
        " WHERE p.id IN (%(first)s, %(second)s) ORDER BY p.id"
    )


PURCHASE_WITH_SLUG = PreparedRaw(Purchase, _purchase_with_ref_sql)


def test_a_prepared_raw_statement_makes_the_instances_raw_makes():
    paid = PaymentAttemptFactory.create(purchase__paid=True, purchase__prepaid=True).purchase
    other = PaymentAttemptFactory.create().purchase
    params = {"first": paid.pk, "second": other.pk}
    sql = _purchase_with_ref_sql(connection.vendor)
    for _ in range(2):  # the first call works out the columns, the second reuses them
        expected = list(Purchase.objects.raw(sql, params))
        found = PURCHASE_WITH_SLUG.fetch(params)
        assert [p.pk for p in found] == [paid.pk, other.pk]
        for got, want in zip(found, expected, strict=True):
            assert _fields(got) == _fields(want)  # datetimes, JSON, states converted alike
            assert got.offering_slug == want.offering_slug  # type: ignore[attr-defined]
            assert got._state.adding is False and got._state.db == "default"
    assert found[0].paid_at == Purchase.objects.get(pk=paid.pk).paid_at  # converted alike
    assert PURCHASE_WITH_SLUG.fetch({"first": -1, "second": -2}) == []


def test_a_prepared_raw_statement_without_the_primary_key_is_refused():
    PaymentAttemptFactory.create()
    without_pk = PreparedRaw(Purchase, lambda vendor: "SELECT ref FROM purchases_purchase")
    with pytest.raises(ValueError, match="primary key"):
        without_pk.fetch([])


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


def test_rows_inserted_by_hand_are_the_rows_bulk_create_writes():
    purchase = PaymentAttemptFactory.create().purchase
    for count in (1, 3, 3):  # a new row count writes its text, the same count reuses it
        by_hand, by_orm = _events(purchase, count), _events(purchase, count)
        before = PurchaseEvent.objects.aggregate(last=Max("pk"))["last"] or 0
        with transaction.atomic():
            insert_rows(by_hand)
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


def test_rows_only_the_orm_can_write_go_through_it():
    purchase = PaymentAttemptFactory.create().purchase
    with pytest.raises(ValueError, match="cannot be written by hand"):
        insert_statement_of([PurchaseEvent(purchase=purchase, subject=Upper(Value("x")))])
    insert_rows([PurchaseEvent(purchase=purchase, subject=Upper(Value("x")), actor_type="system")])
    assert PurchaseEvent.objects.filter(purchase=purchase, subject="X").exists()


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


def _unclaimed(pk: int, now: datetime) -> tuple[models.QuerySet[Purchase], dict[str, Any]]:
    return Purchase.objects.filter(pk=pk, paid_at__isnull=True), {
        "paid_at": now,
        "amount": F("amount") + 1,
    }


CLAIM_UNPAID = PreparedUpdate(_unclaimed, pk=int, now=datetime)


def test_a_prepared_update_runs_the_statement_update_runs():
    first, second = (PaymentAttemptFactory.create().purchase for _ in range(2))
    now = timezone.now()
    with CaptureQueriesContext(connection) as orm:
        queryset, values = _unclaimed(first.pk, now)
        assert queryset.update(**values) == 1
    with CaptureQueriesContext(connection) as prepared:
        assert CLAIM_UNPAID.run(pk=second.pk, now=now) == 1
        assert CLAIM_UNPAID.run(pk=second.pk, now=now) == 0  # no longer unpaid
    written = orm.captured_queries[-1]["sql"].replace(f'"id" = {first.pk})', f'"id" = {second.pk})')
    assert prepared.captured_queries[0]["sql"] == written
    for purchase in (first, second):
        stored = Purchase.objects.get(pk=purchase.pk)
        assert (stored.paid_at, stored.amount) == (now, purchase.amount + 1)


def test_a_prepared_update_refuses_a_parameter_the_orm_transforms():
    by_payer = PreparedUpdate(
        lambda payer: (Purchase.objects.filter(payer__icontains=payer), {"reason_code": "x"}),
        payer=str,
    )
    with pytest.raises(ValueError, match="payer"):
        by_payer.run(payer="0xabc")
