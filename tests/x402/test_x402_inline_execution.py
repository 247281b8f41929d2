"""A paid call for fast in-process work is answered with its result by the request itself:
no worker runs here at all, and the execution job staged for one never reaches the broker
(real Redis) unless the request leaves the work to a worker. If the process dies after the
settlement's commit, the relay loop sends the job after its grace and a real worker
finishes the purchase, once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings as django_settings
from django.utils import timezone
from rest_framework.test import APIClient

from fulfillment.executors.base import ExecutorError
from fulfillment.executors.report import ReportExecutor
from fulfillment.models import ExecutionAttempt
from payments.models import PaymentAttempt
from purchases.models import OutboxMessage, Purchase
from purchases.services.fulfil.execution import ExecutionOutcome, purchase_execute
from purchases.services.fulfil.result_wait import listeners_close
from purchases.services.jobs.reconcile import reconcile_pending_settlements
from purchases.services.shared.outbox import outbox_relay_due
from tests.fixtures.broker import BrokerQueue
from tests.fixtures.worker import ROOT, _database_url
from tests.integration.helpers import wait_for
from tests.x402.e2e import PRICE, MakeWorld, X402World, ask, sign_payment

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
EXECUTE_TASK = "purchases.tasks.purchase_execute_task"
INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\n"}


@pytest.fixture(autouse=True)
def _listener_closed_after_each_test() -> Iterator[None]:
    yield
    listeners_close()  # its connection would keep the test database open


def _pay(world: X402World, client: APIClient, payment_id: str | None = None) -> tuple[str, Any]:
    payment = sign_payment(
        ask(client, world).headers["PAYMENT-REQUIRED"], world.payers[0], payment_id
    )
    return payment, ask(client, world, payment=payment)


def _execution_message(purchase: Purchase) -> OutboxMessage:
    return OutboxMessage.objects.get(dedup_key=f"purchase_execute:{purchase.pk}")


def test_paid_call_answers_with_the_result_and_sends_nothing_to_the_broker(
    x402_live_world: X402World, settings, broker_queue: BrokerQueue
) -> None:
    world, client = x402_live_world, APIClient()
    settings.X402_RESULT_WAIT_SECONDS = 30
    _, paid = _pay(world, client)

    assert paid.status_code == 200, paid.content
    assert json.loads(paid.content)["title"] == "Sales"
    purchase = Purchase.objects.get()
    assert purchase.fulfillment_state == Purchase.FulfillmentState.SUCCEEDED
    assert PaymentAttempt.objects.get().state == PaymentAttempt.State.SUCCEEDED
    assert world.seller_balance() == PRICE
    attempt = ExecutionAttempt.objects.get()
    assert attempt.worker.startswith("web:")
    # The job was staged with the settlement (the guarantee had this process died), held
    # back from the broker, and retired once the request had done the work: never sent.
    message = _execution_message(purchase)
    assert (message.status, message.relayed_at, message.attempts) == ("retired", None, 0)
    assert broker_queue.tasks() == []
    # Not even by the relay loop, long after the grace.
    assert outbox_relay_due(now=timezone.now() + timedelta(hours=1))["claimed"] == 0
    assert broker_queue.tasks() == []
    # A worker given the purchase anyway (the sweeper) finds nothing to do.
    assert purchase_execute(purchase_id=purchase.pk, worker="w1") == ExecutionOutcome.OBSERVED
    assert ExecutionAttempt.objects.count() == 1


def test_a_paid_call_that_may_not_wait_sends_the_job_at_its_commit(
    x402_live_world: X402World, settings, broker_queue: BrokerQueue
) -> None:
    world, client = x402_live_world, APIClient()
    settings.X402_RESULT_WAIT_SECONDS = 0  # nothing runs in the request
    _, paid = _pay(world, client)

    assert paid.status_code == 202, paid.content
    purchase = Purchase.objects.get()
    assert broker_queue.tasks() == [(EXECUTE_TASK, {"purchase_id": purchase.pk})]
    message = _execution_message(purchase)
    assert (message.status, message.retired_at, message.attempts) == ("relayed", None, 1)
    assert not ExecutionAttempt.objects.exists()


@pytest.mark.parametrize(
    "failure",
    [RuntimeError("the executor crashed"), ExecutorError("executor_unreachable")],
    ids=["error", "retryable"],
)
def test_an_inline_run_that_does_not_finish_sends_the_job_at_once(
    x402_live_world: X402World,
    settings,
    broker_queue: BrokerQueue,
    monkeypatch: pytest.MonkeyPatch,
    failure: Exception,
) -> None:
    def start(self: object, job: object) -> None:
        raise failure

    monkeypatch.setattr(ReportExecutor, "start", start)
    world, client = x402_live_world, APIClient()
    settings.X402_RESULT_WAIT_SECONDS = 0.2  # the wait after the failed run gives up soon
    _, paid = _pay(world, client)

    assert paid.status_code == 202, paid.content
    purchase = Purchase.objects.get()
    assert purchase.payment_state == Purchase.PaymentState.PAID
    assert purchase.fulfillment_state == Purchase.FulfillmentState.RUNNING
    # Left to a worker, which gets it now: one message, sent once, not retired.
    assert broker_queue.tasks() == [(EXECUTE_TASK, {"purchase_id": purchase.pk})]
    message = _execution_message(purchase)
    assert (message.status, message.retired_at, message.attempts) == ("relayed", None, 1)
    assert ExecutionAttempt.objects.get().tries == 1


def test_a_settlement_confirmed_in_the_background_is_relayed_as_before(
    make_x402_world: MakeWorld, settings, broker_queue: BrokerQueue
) -> None:
    world, client = make_x402_world(no_mining=True), APIClient()
    settings.X402_RESULT_WAIT_SECONDS = 30
    _, pending = _pay(world, client)
    assert pending.status_code == 202 and pending.json()["status"] == "settlement_pending"
    assert not OutboxMessage.objects.exists()  # nothing queued while the money is unproven

    world.node.mine()
    later = timezone.now() + settings.TOLLBOOTH["SETTLEMENT_GRACE"] + timedelta(seconds=1)
    assert reconcile_pending_settlements(now=later)["confirmed"] == 1

    purchase = Purchase.objects.get()
    assert purchase.fulfillment_state == Purchase.FulfillmentState.QUEUED
    message = _execution_message(purchase)
    assert message.status == "waiting" and message.available_at <= later  # due at once
    assert outbox_relay_due(now=later)["sent"] == 1
    assert broker_queue.tasks() == [(EXECUTE_TASK, {"purchase_id": purchase.pk})]
    assert _execution_message(purchase).status == "relayed"


def test_a_resent_payment_that_settles_and_runs_the_work_retires_the_job(
    make_x402_world: MakeWorld, settings, broker_queue: BrokerQueue
) -> None:
    world, client = make_x402_world(no_mining=True), APIClient()
    settings.X402_RESULT_WAIT_SECONDS = 30
    payment, pending = _pay(world, client, "x402-inline-resent-0001")
    assert pending.status_code == 202

    world.node.mine()
    paid = ask(client, world, payment=payment)  # the same signed payment: settles, then runs

    assert paid.status_code == 200, paid.content
    purchase = Purchase.objects.get()
    assert purchase.fulfillment_state == Purchase.FulfillmentState.SUCCEEDED
    assert _execution_message(purchase).status == "retired"
    assert broker_queue.tasks() == []


# Pays in a process of its own that is SIGKILLed where its inline run would start: the
# settlement (and with it the execution job, held back from the broker) has committed.
_DIES_BEFORE_THE_INLINE_RUN = """
import json, os, signal, sys
import django
django.setup()
from rest_framework.test import APIClient
from purchases.services.fulfil import result_wait
result_wait._execute_inline = lambda purchase_id: os.kill(os.getpid(), signal.SIGKILL)
APIClient().post(sys.argv[1], json.loads(sys.argv[2]), format="json",
                 HTTP_PAYMENT_SIGNATURE=sys.argv[3])
"""


@pytest.mark.worker
def test_a_held_job_whose_process_died_is_sent_after_its_grace_and_run_once_by_a_worker(
    x402_live_world: X402World, start_worker, tmp_path: Path
) -> None:
    world, client = x402_live_world, APIClient()
    payment = sign_payment(ask(client, world).headers["PAYMENT-REQUIRED"], world.payers[0], None)
    private_queue = f"tests-web-{uuid.uuid4().hex[:12]}"  # where the dead process would send
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings.test",
        "DATABASE_URL": _database_url(),
        "REDIS_URL": django_settings.REDIS_URL,
        "TOLLBOOTH_CELERY_QUEUE": private_queue,
        "TOLLBOOTH_VAR_DIR": str(tmp_path / "var-web"),
        "X402_LOCAL_RPC_URL": world.node.rpc_url,
        "X402_LOCAL_TOKEN": world.token,
        "X402_LOCAL_RELAYER_KEY": world.relayer.key.hex(),
        "X402_LOCAL_MODE": "direct",
        "X402_RESULT_WAIT_SECONDS": "30",
    }
    web = subprocess.run(
        [
            sys.executable,
            "-c",
            _DIES_BEFORE_THE_INLINE_RUN,
            world.paid_url,
            json.dumps(INPUT),
            payment,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )

    assert web.returncode == -signal.SIGKILL, web.stderr.decode()
    purchase = Purchase.objects.get()
    assert (purchase.payment_state, purchase.fulfillment_state) == ("paid", "queued")
    assert world.seller_balance() == PRICE
    message = _execution_message(purchase)
    assert (message.status, message.attempts) == ("waiting", 0)
    client_redis = redis.Redis.from_url(django_settings.REDIS_URL)
    try:
        assert client_redis.llen(private_queue) == 0  # held: the dead process sent nothing
    finally:
        client_redis.delete(private_queue)
        client_redis.close()
    # Within its grace the relay loop leaves it to the request that staged it ...
    just_before = message.available_at - timedelta(seconds=1)
    assert outbox_relay_due(now=just_before)["claimed"] == 0

    start_worker("w1")
    # ... after it, the loop sends it, and the worker runs the purchase.
    assert outbox_relay_due(now=message.available_at)["sent"] == 1
    wait_for(
        lambda: Purchase.objects.get(pk=purchase.pk).fulfillment_state == "succeeded",
        timeout=60,
        message="the worker to finish the purchase",
    )
    attempt = ExecutionAttempt.objects.get(purchase_id=purchase.pk)  # exactly one execution
    assert attempt.worker.startswith("w1@tests:") and attempt.tries == 1
    assert _execution_message(purchase).status == "relayed"
