"""A paid request waiting for its result is woken by the commit that stores it (PostgreSQL
NOTIFY), reads again on its own when a notification is lost, and runs fast in-process work
itself, exactly once under the execution claim; the execution job staged for it reaches the
broker (real Redis) only when the request leaves the work to a worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from django.db import connection, transaction

from fulfillment.executors.report import ReportExecutor
from fulfillment.models import ExecutionAttempt
from purchases.models import OutboxMessage, Purchase
from purchases.services.fulfil import execution, result_wait
from purchases.services.fulfil.execution import ExecutionOutcome, purchase_execute
from purchases.services.fulfil.result_notify import fulfillment_notify
from purchases.services.fulfil.sweeper import purchase_execution_stage
from purchases.services.shared.outbox import outbox_stage
from tests.factories import PaymentAttemptFactory, PurchaseFactory
from tests.fixtures.broker import BrokerQueue

pytestmark = [pytest.mark.django_db(transaction=True)]
# PostgreSQL only: the waiter's LISTEN/NOTIFY wake-up (the embedded default's waiters poll).
LISTEN_NOTIFY = pytest.mark.postgres
RUN = Purchase.FulfillmentState
# Longer than any join below: a waiter that returns did not wait for its fallback read.
NEVER = 600.0
REPORT_INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\n"}


@pytest.fixture(autouse=True)
def _listener_closed_after_each_test() -> Iterator[None]:
    yield
    result_wait.listeners_close()  # its connection would keep the test database open


def _wait_in_thread(purchase_id: int, fallback: float) -> tuple[threading.Thread, list[str]]:
    returned: list[str] = []

    def wait() -> None:
        try:
            returned.append(
                result_wait.fulfillment_wait(
                    purchase_id=purchase_id,
                    waiting={RUN.QUEUED, RUN.RUNNING},
                    deadline=time.monotonic() + NEVER,
                    fallback_seconds=fallback,
                )
            )
        finally:
            connection.close()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread, returned


def _until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("condition never held")


def _registered(purchase_id: int) -> bool:
    listener = result_wait._listener()
    return listener._listening.is_set() and bool(listener._waiters.get(purchase_id))


def _finish(purchase: Purchase, *, notify: bool) -> None:
    with transaction.atomic():
        Purchase.objects.filter(pk=purchase.pk).update(fulfillment_state=RUN.SUCCEEDED)
        if notify:
            fulfillment_notify(purchase=purchase)


@LISTEN_NOTIFY
def test_the_waiter_is_woken_by_the_commit_that_stores_the_result() -> None:
    purchase = PurchaseFactory.create(paid=True, fulfillment_state=RUN.RUNNING)
    thread, returned = _wait_in_thread(purchase.pk, fallback=NEVER)
    _until(lambda: _registered(purchase.pk))
    before = result_wait._listener().notifications

    _finish(purchase, notify=True)

    thread.join(timeout=30)
    assert returned == [RUN.SUCCEEDED]
    # The listener counts a notification after it has woken the waiter: wait for the count.
    _until(lambda: result_wait._listener().notifications > before)


@LISTEN_NOTIFY
def test_a_rolled_back_change_wakes_nobody() -> None:
    purchase = PurchaseFactory.create(paid=True, fulfillment_state=RUN.RUNNING)
    thread, returned = _wait_in_thread(purchase.pk, fallback=NEVER)
    _until(lambda: _registered(purchase.pk))
    with pytest.raises(RuntimeError), transaction.atomic():
        fulfillment_notify(purchase=purchase)
        raise RuntimeError("the storing transaction fails")

    _finish(purchase, notify=True)  # the real one, so the thread ends

    thread.join(timeout=30)
    assert returned == [RUN.SUCCEEDED]


@LISTEN_NOTIFY
def test_a_lost_notification_costs_one_fallback_read_not_the_answer() -> None:
    purchase = PurchaseFactory.create(paid=True, fulfillment_state=RUN.RUNNING)
    thread, returned = _wait_in_thread(purchase.pk, fallback=0.05)
    _until(lambda: _registered(purchase.pk))

    _finish(purchase, notify=False)  # stored, but nobody told

    thread.join(timeout=30)
    assert returned == [RUN.SUCCEEDED]


def test_a_waiter_gives_up_at_its_deadline_with_the_state_it_read() -> None:
    purchase = PurchaseFactory.create(paid=True, fulfillment_state=RUN.RUNNING)
    state = result_wait.fulfillment_wait(
        purchase_id=purchase.pk,
        waiting={RUN.QUEUED, RUN.RUNNING},
        deadline=time.monotonic(),
    )
    assert state == RUN.RUNNING


def test_fast_work_runs_inline_once_and_a_worker_coming_second_finds_nothing_to_do() -> None:
    purchase = PurchaseFactory.create(paid=True, quote__canonical_input=REPORT_INPUT)
    PaymentAttemptFactory.create(purchase=purchase, succeeded=True)
    assert purchase.fulfillment_state == RUN.QUEUED

    answered = result_wait.purchase_await_result(purchase=purchase, wait_seconds=30)

    assert answered.fulfillment_state == RUN.SUCCEEDED
    attempt = ExecutionAttempt.objects.get(purchase_id=purchase.pk)
    assert attempt.worker.startswith("web:")
    # The staged job reaches a worker after all: the claim lets nobody run it again.
    assert purchase_execute(purchase_id=purchase.pk, worker="w1") == ExecutionOutcome.OBSERVED
    assert ExecutionAttempt.objects.filter(purchase_id=purchase.pk).count() == 1


def test_no_inline_run_when_the_request_may_not_wait() -> None:
    purchase = PurchaseFactory.create(paid=True)

    answered = result_wait.purchase_await_result(purchase=purchase, wait_seconds=0)

    assert answered.fulfillment_state == RUN.QUEUED
    assert not ExecutionAttempt.objects.filter(purchase_id=purchase.pk).exists()


def test_work_the_request_runs_inline_runs_even_when_a_slow_settlement_left_no_wait(
    broker_queue: BrokerQueue,
) -> None:
    # The request's scope decided on its whole budget that it runs the work itself; the
    # settlement then used the budget up. The work is not a wait: it still runs, once.
    purchase = _paid_report()
    with result_wait.purchase_inline_execution_scope(offering=purchase.offering, wait_seconds=10):
        staged = _stage_execution(purchase)
        answered = result_wait.purchase_await_result(purchase=purchase, wait_seconds=0)

    assert answered.fulfillment_state == RUN.SUCCEEDED
    assert ExecutionAttempt.objects.get(purchase_id=purchase.pk).worker.startswith("web:")
    staged.refresh_from_db()
    assert staged.status == "retired"
    assert broker_queue.tasks() == []


# --- the execution job of an inline run: held back from the broker, retired or sent ---------

EXECUTE_TASK = "purchases.tasks.purchase_execute_task"


def _paid_report() -> Purchase:
    purchase = PurchaseFactory.create(paid=True, quote__canonical_input=REPORT_INPUT)
    PaymentAttemptFactory.create(purchase=purchase, succeeded=True)
    return Purchase.objects.select_related("offering", "quote").get(pk=purchase.pk)


def _stage_execution(purchase: Purchase) -> OutboxMessage:
    with transaction.atomic():  # as the settlement does, in the transaction that queues it
        message_id = purchase_execution_stage(purchase_id=purchase.pk)
    assert message_id is not None
    return OutboxMessage.objects.get(pk=message_id)


def test_the_job_of_a_finished_inline_run_is_retired_and_never_reaches_the_broker(
    broker_queue: BrokerQueue,
) -> None:
    purchase = _paid_report()
    with result_wait.purchase_inline_execution_scope(offering=purchase.offering, wait_seconds=30):
        staged = _stage_execution(purchase)
        staged.refresh_from_db()
        assert staged.status == "waiting"  # committed, and held back from the broker
        answered = result_wait.purchase_await_result(purchase=purchase, wait_seconds=30)

    assert answered.fulfillment_state == RUN.SUCCEEDED
    staged.refresh_from_db()
    assert (staged.status, staged.relayed_at, staged.attempts) == ("retired", None, 0)
    assert staged.retired_at is not None
    assert broker_queue.tasks() == []
    # Retired is not waiting: a later staging of the same job (the sweeper's) is not blocked.
    with transaction.atomic():
        again = purchase_execution_stage(purchase_id=purchase.pk)
    assert again is not None and again != staged.pk


def test_a_job_another_worker_holds_is_sent_at_once(broker_queue: BrokerQueue) -> None:
    purchase = _paid_report()
    assert execution._claim(purchase.pk, "w1@elsewhere:task-1") is not None  # live lease
    with result_wait.purchase_inline_execution_scope(offering=purchase.offering, wait_seconds=30):
        staged = _stage_execution(purchase)
        answered = result_wait.purchase_await_result(purchase=purchase, wait_seconds=0.1)
        # Sent right after the inline run observed the other worker, not at the scope's end.
        assert broker_queue.tasks() == [(EXECUTE_TASK, {"purchase_id": purchase.pk})]

    assert answered.fulfillment_state == RUN.RUNNING
    staged.refresh_from_db()
    assert (staged.status, staged.retired_at, staged.attempts) == ("relayed", None, 1)
    assert ExecutionAttempt.objects.get(purchase_id=purchase.pk).worker == "w1@elsewhere:task-1"


def test_an_inline_run_that_raises_sends_its_job_at_once(
    broker_queue: BrokerQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(self: object, job: object) -> None:
        raise RuntimeError("the executor crashed")

    monkeypatch.setattr(ReportExecutor, "start", crash)
    purchase = _paid_report()
    with result_wait.purchase_inline_execution_scope(offering=purchase.offering, wait_seconds=30):
        staged = _stage_execution(purchase)
        answered = result_wait.purchase_await_result(purchase=purchase, wait_seconds=0.1)
        assert broker_queue.tasks() == [(EXECUTE_TASK, {"purchase_id": purchase.pk})]

    assert answered.fulfillment_state == RUN.RUNNING  # left to a worker under the lease rules
    staged.refresh_from_db()
    assert (staged.status, staged.attempts) == ("relayed", 1)


def test_a_scope_left_without_an_inline_run_sends_its_job_as_it_ends(
    broker_queue: BrokerQueue,
) -> None:
    purchase = _paid_report()
    with (
        pytest.raises(RuntimeError, match="before the wait"),
        result_wait.purchase_inline_execution_scope(offering=purchase.offering, wait_seconds=30),
    ):
        staged = _stage_execution(purchase)
        assert broker_queue.tasks() == []
        raise RuntimeError("the request failed before the wait")

    assert broker_queue.tasks() == [(EXECUTE_TASK, {"purchase_id": purchase.pk})]
    staged.refresh_from_db()
    assert (staged.status, staged.attempts) == ("relayed", 1)
    assert not ExecutionAttempt.objects.filter(purchase_id=purchase.pk).exists()


def test_only_the_execution_job_of_an_inline_run_is_held(broker_queue: BrokerQueue) -> None:
    purchase = _paid_report()
    other = _paid_report()
    # A request that will not run the work (no wait) holds nothing: relayed at its commit.
    with result_wait.purchase_inline_execution_scope(offering=purchase.offering, wait_seconds=0):
        _stage_execution(purchase)
        assert broker_queue.tasks() == [(EXECUTE_TASK, {"purchase_id": purchase.pk})]
    # Inside a holding scope, another job is relayed at its commit as everywhere else.
    with result_wait.purchase_inline_execution_scope(offering=other.offering, wait_seconds=30):
        with transaction.atomic():
            outbox_stage(job="refund_alert", kwargs={"refund_id": 7}, dedup_key="refund_alert:7")
        assert broker_queue.tasks()[1:] == [("purchases.tasks.refund_alert_task", {"refund_id": 7})]
        result_wait.purchase_await_result(purchase=other, wait_seconds=30)
    assert len(broker_queue.tasks()) == 2
