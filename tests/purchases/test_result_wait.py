"""A paid request waiting for its result is woken by the commit that stores it (PostgreSQL
NOTIFY), reads again on its own when a notification is lost, and runs fast in-process work
itself, exactly once under the execution claim."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from django.db import connection, transaction

from fulfillment.models import ExecutionAttempt
from purchases.models import Purchase
from purchases.services import result_wait
from purchases.services.execution import ExecutionOutcome, purchase_execute
from purchases.services.result_notify import fulfillment_notify
from tests.factories import PaymentAttemptFactory, PurchaseFactory

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
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
