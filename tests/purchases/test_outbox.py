"""The outbox: a job is staged with the change or not at all, relayed right after the
commit, and otherwise by the relay loop, which backs off on a broker failure and never
sends one message from two loops. Real PostgreSQL; the two-loop race counts messages on
real Redis."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from kombu.exceptions import OperationalError

from doors.rest.prepaid_answers import PrepaidAnswers
from purchases.models import JobRun, OutboxMessage, Purchase
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from purchases.services.fulfil.sweeper import purchase_execution_stage, purchases_sweep_stalled
from purchases.services.quote.quotes import quote_create
from purchases.services.shared import outbox
from purchases.services.shared.outbox import outbox_prune, outbox_relay_due, outbox_stage
from tests.conftest import CSV_INPUT

pytestmark = [pytest.mark.django_db(transaction=True)]


class Sent:
    """Stands in for the broker: records what the relay hands over, or fails like it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.down = False

    def __call__(self, job: str, kwargs: dict[str, Any]) -> None:
        if self.down:
            raise OperationalError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
        self.calls.append((job, kwargs))


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Sent:
    recorder = Sent()
    monkeypatch.setattr(outbox, "_send", recorder)
    return recorder


@pytest.fixture
def no_immediate_relay(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if the process died right after the commit, before the immediate relay ran."""
    monkeypatch.setattr(outbox, "_relay_staged", lambda **_: None)


def _pay(buyer: Any, offering: Any, payment_id: str) -> Purchase:
    quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=CSV_INPUT).quote
    answer, _ = purchase_pay_prepaid(
        answers=PrepaidAnswers(), buyer=buyer, quote_id=quote.public_id, payment_id=payment_id
    )
    return Purchase.objects.get(ref=answer.purchase_ref)


def _stage_committed(n: int, *, now: Any = None) -> list[int]:
    with transaction.atomic():
        ids = [outbox_stage(job="refund_alert", kwargs={"refund_id": i}, now=now) for i in range(n)]
    return [i for i in ids if i is not None]


def test_a_rolled_back_payment_leaves_no_job_and_a_committed_one_exactly_one(buyer, offering, sent):
    quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=CSV_INPUT).quote
    with pytest.raises(RuntimeError, match="after the payment"), transaction.atomic():
        purchase_pay_prepaid(
            answers=PrepaidAnswers(),
            buyer=buyer,
            quote_id=quote.public_id,
            payment_id="outbox-rollback-0001",
        )
        raise RuntimeError("something failed after the payment, in the same transaction")

    assert Purchase.objects.count() == 0
    assert OutboxMessage.objects.count() == 0
    assert sent.calls == []

    purchase = _pay(buyer, offering, "outbox-committed-0001")

    message = OutboxMessage.objects.get()
    assert (message.job, message.kwargs, message.dedup_key) == (
        "purchase_execute",
        {"purchase_id": purchase.pk},
        f"purchase_execute:{purchase.pk}",
    )
    # Relayed right after the commit, once.
    assert sent.calls == [("purchase_execute", {"purchase_id": purchase.pk})]
    assert message.relayed_at is not None
    assert message.attempts == 1


def test_staging_one_job_twice_in_one_flow_stages_it_once(sent, no_immediate_relay):
    with transaction.atomic():
        first = purchase_execution_stage(purchase_id=41)
        second = purchase_execution_stage(purchase_id=41)
        other = purchase_execution_stage(purchase_id=42)

    assert first is not None and other is not None
    assert second is None
    assert sorted(OutboxMessage.objects.values_list("kwargs", flat=True), key=str) == [
        {"purchase_id": 41},
        {"purchase_id": 42},
    ]


def test_a_job_already_relayed_can_be_staged_again(sent):
    with transaction.atomic():
        purchase_execution_stage(purchase_id=7)
    with transaction.atomic():
        again = purchase_execution_stage(purchase_id=7)

    assert again is not None
    assert OutboxMessage.objects.filter(dedup_key="purchase_execute:7").count() == 2
    assert sent.calls == [("purchase_execute", {"purchase_id": 7})] * 2


def test_staging_outside_a_transaction_or_an_unknown_job_is_refused(sent):
    with pytest.raises(RuntimeError, match="inside the transaction"):
        outbox_stage(job="refund_alert", kwargs={"refund_id": 1})
    with pytest.raises(ValueError, match="unknown outbox job"), transaction.atomic():
        outbox_stage(job="refund_alrt", kwargs={"refund_id": 1})

    assert OutboxMessage.objects.count() == 0
    assert sent.calls == []


def test_a_failed_immediate_relay_never_fails_the_committed_change(buyer, offering, sent):
    sent.down = True

    purchase = _pay(buyer, offering, "outbox-broker-down-01")

    assert purchase.fulfillment_state == Purchase.FulfillmentState.QUEUED
    message = OutboxMessage.objects.get()
    assert message.relayed_at is None
    assert message.attempts == 1
    assert "Connection refused" in message.last_error
    assert message.available_at > message.created_at


def test_the_loop_leaves_a_fresh_message_to_the_immediate_relay_then_sends_it(
    sent, no_immediate_relay
):
    now = timezone.now()
    [message_id] = _stage_committed(1, now=now)
    grace = settings.TOLLBOOTH["OUTBOX_RELAY_GRACE"]

    early = outbox_relay_due(now=now + grace - timedelta(seconds=1))
    late = outbox_relay_due(now=now + grace)

    assert early["claimed"] == 0
    assert (late["claimed"], late["sent"]) == (1, 1)
    assert sent.calls == [("refund_alert", {"refund_id": 0})]
    message = OutboxMessage.objects.get(pk=message_id)
    assert (message.relayed_at, message.attempts) == (now + grace, 1)
    run = JobRun.objects.get(job="outbox_relay", started_at=now + grace)
    assert run.stats == {"claimed": 1, "sent": 1}
    assert run.finished_at is not None


def test_a_broker_failure_keeps_the_row_backs_off_and_gives_the_batch_back(
    sent, no_immediate_relay
):
    now = timezone.now() - timedelta(hours=1)
    first, *rest = _stage_committed(3, now=now)
    sent.down = True
    run_at = timezone.now()

    stats = outbox_relay_due(now=run_at)

    assert stats == Counter(claimed=3, failed=1, given_back=2)
    failed = OutboxMessage.objects.get(pk=first)
    assert (failed.relayed_at, failed.attempts) == (None, 1)
    assert "Connection refused" in failed.last_error
    # 2 s for the first failure, with up to 25 % jitter taken off.
    assert run_at + timedelta(seconds=1.5) <= failed.available_at <= run_at + timedelta(seconds=2)
    # The rest of the batch was never tried: no attempt counted, due again at once.
    for message in OutboxMessage.objects.filter(pk__in=rest):
        assert (message.relayed_at, message.attempts, message.available_at) == (None, 0, run_at)

    sent.down = False
    retry = outbox_relay_due(now=failed.available_at)

    assert (retry["claimed"], retry["sent"]) == (3, 3)
    assert OutboxMessage.objects.filter(relayed_at__isnull=True).count() == 0
    assert OutboxMessage.objects.get(pk=first).attempts == 2


def test_repeated_failures_back_off_exponentially_to_a_cap(sent, no_immediate_relay):
    [message_id] = _stage_committed(1, now=timezone.now() - timedelta(hours=1))
    sent.down = True
    delays = []
    for _ in range(10):
        run_at = OutboxMessage.objects.get(pk=message_id).available_at
        outbox_relay_due(now=run_at)
        delays.append((OutboxMessage.objects.get(pk=message_id).available_at - run_at).seconds)

    # 2, 4, 8 ... s less up to 25 % jitter, never more than 5 min.
    for attempt, delay in enumerate(delays, start=1):
        ceiling = min(300, 2**attempt)
        assert 0.75 * ceiling - 1 <= delay <= ceiling
    assert OutboxMessage.objects.get(pk=message_id).attempts == 10


@pytest.mark.redis
def test_two_relay_loops_at_once_never_send_a_message_twice(
    monkeypatch: pytest.MonkeyPatch, no_immediate_relay
):
    # Real Redis, a queue of this test's own: count what actually reached the broker.
    queue = f"outbox-race-{uuid.uuid4().hex[:8]}"
    producer = Celery("outbox-race", broker=settings.REDIS_URL, set_as_current=False)
    producer.conf.task_default_queue = queue
    monkeypatch.setattr(outbox, "_celery", lambda: producer)
    monkeypatch.setattr(outbox, "RELAY_BATCH", 10)
    handed_over: Counter[int] = Counter()
    real_send = outbox._send

    def counting_send(job: str, kwargs: dict[str, Any]) -> None:
        real_send(job, kwargs)
        handed_over[kwargs["refund_id"]] += 1

    monkeypatch.setattr(outbox, "_send", counting_send)
    _stage_committed(300, now=timezone.now() - timedelta(minutes=5))
    start = threading.Barrier(2)
    results: list[Counter[str]] = []

    def loop() -> None:
        try:
            start.wait()
            results.append(outbox_relay_due())
        finally:
            connection.close()

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        on_broker = client.llen(queue)
    finally:
        client.delete(queue)

    assert on_broker == 300
    assert handed_over == Counter(dict.fromkeys(range(300), 1))
    assert sum(r["sent"] for r in results) == 300
    assert OutboxMessage.objects.filter(relayed_at__isnull=True).count() == 0


def test_the_sweeper_stages_through_the_outbox_once_per_waiting_purchase(
    buyer, offering, sent, no_immediate_relay
):
    purchase = _pay(buyer, offering, "outbox-sweeper-0001")
    later = timezone.now() + settings.TOLLBOOTH["SWEEP_GRACE"] + timedelta(seconds=1)

    first = purchases_sweep_stalled(now=later)
    second = purchases_sweep_stalled(now=later)

    assert (first["re_enqueued"], second["re_enqueued"]) == (1, 1)
    # The payment's own message is still waiting: the sweeps add nothing to it.
    assert list(OutboxMessage.objects.values_list("job", "kwargs")) == [
        ("purchase_execute", {"purchase_id": purchase.pk})
    ]
    assert JobRun.objects.filter(job="executions").count() == 2


def test_prune_deletes_relayed_and_retired_messages_past_retention_in_batches(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(outbox, "PRUNE_BATCH", 2)
    now = timezone.now()
    old = now - settings.TOLLBOOTH["OUTBOX_RETENTION"] - timedelta(minutes=1)

    def message(relayed_at: Any, retired_at: Any = None) -> int:
        return OutboxMessage.objects.create(
            job="refund_alert",
            created_at=old,
            available_at=old,
            relayed_at=relayed_at,
            retired_at=retired_at,
        ).pk

    for _ in range(3):
        message(old)
    for _ in range(2):
        message(None, retired_at=old)
    recent = message(now - timedelta(hours=1))
    recently_retired = message(None, retired_at=now - timedelta(hours=1))
    waiting = message(None)
    last_success = JobRun.objects.create(
        job="outbox_relay", started_at=old - timedelta(hours=2), finished_at=old
    )
    JobRun.objects.create(job="outbox_relay", started_at=old, error="boom")
    other_job = JobRun.objects.create(job="alerts", started_at=old, finished_at=old)
    # heal-relayers runs every few seconds too: its old runs go, its last success stays.
    heal_kept = JobRun.objects.create(job="heal_relayers", started_at=old, finished_at=old)
    JobRun.objects.create(job="heal_relayers", started_at=old - timedelta(hours=1))

    stats = outbox_prune(now=now)

    assert stats == Counter(pruned=5, relay_runs_pruned=1, heal_runs_pruned=1)
    assert set(OutboxMessage.objects.values_list("pk", flat=True)) == {
        recent,
        recently_retired,
        waiting,
    }
    remaining = set(JobRun.objects.exclude(job="prune_outbox").values_list("pk", flat=True))
    assert remaining == {last_success.pk, other_job.pk, heal_kept.pk}


def test_every_outbox_job_and_beat_entry_names_a_registered_task():
    import purchases.tasks  # noqa: F401  (registers the tasks, as a worker does)
    import webhooks.tasks  # noqa: F401  (autodiscover_tasks finds it in a worker)
    from config.celery_app import app

    named = set(settings.OUTBOX_JOBS.values()) | {
        entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()
    }
    assert named - set(app.tasks) == set()
