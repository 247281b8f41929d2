"""What keeps reconciliation at 10,000 rows from growing with the attempt table and the
timeline: the claim reads a partial index of the pending attempts, and a bulk recorder's
events go in with one COPY, read back as an INSERT would have written them."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from core.actors import Actor
from core.bulk import bulk_insert_rows
from purchases.events import COPY_FROM, event_record, events_batched
from purchases.models import PurchaseEvent
from purchases.services.jobs import reconcile
from purchases.services.settle import finality
from tests.factories import PurchaseFactory

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]


def _attempt_reads(run) -> list[str]:
    with CaptureQueriesContext(connection) as queries:
        run()
    return [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].startswith("SELECT") and '"payments_paymentattempt"' in q["sql"]
    ]


@pytest.mark.parametrize("step", ["claim", "resume"])
def test_claim_and_resume_read_the_pending_index(step):
    now = timezone.now()
    run = {
        "claim": lambda: reconcile._claim_due(now, 20_000),
        "resume": lambda: reconcile._resume_unbroadcast(now, reconcile.Counter()),
    }[step]
    (sql,) = _attempt_reads(run)
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a tiny table would be scanned anyway
        cursor.execute(f"EXPLAIN {sql}")
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("SET LOCAL enable_seqscan = on")
    assert "attempt_pending_scale" in plan and "Seq Scan" not in plan, plan


def test_finality_claim_reads_the_unfinal_index():
    """Every settled payment ever made stays in the table; the watch reads the few not final."""
    now = timezone.now()
    (sql,) = _attempt_reads(lambda: finality._claim_due(now, 5000))
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(f"EXPLAIN {sql}")
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("SET LOCAL enable_seqscan = on")
    assert "attempt_unfinal_scale" in plan and "Seq Scan" not in plan, plan


def test_pending_index_holds_only_pending_attempts():
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = 'attempt_pending_scale'")
        (definition,) = cursor.fetchone()
    assert "(network, id)" in definition
    assert "'recorded'" in definition and "'settlement_pending'" in definition
    assert "'succeeded'" not in definition and "'failed'" not in definition


@pytest.mark.parametrize("copy_from", [1, 1000], ids=["copy", "insert"])
def test_bulk_events_read_back_as_written(copy_from):
    purchases = PurchaseFactory.create_batch(3)
    events = [
        PurchaseEvent(
            purchase=purchase,
            subject="payment_attempt",
            from_state="settlement_pending",
            to_state="succeeded",
            actor_type="system",
            actor="settlement",
            reason_code="",
            evidence={"tx_hash": "0x" + "ab" * 32, "block": i, "note": "tab\there, é", "n": None},
        )
        for i, purchase in enumerate(purchases)
    ]
    before = timezone.now()
    bulk_insert_rows(events, copy_from=copy_from)
    stored = list(PurchaseEvent.objects.filter(purchase__in=purchases).order_by("pk"))
    assert [(e.purchase_id, e.evidence) for e in stored] == [
        (e.purchase_id, e.evidence) for e in events
    ]
    assert all(before <= e.created_at <= timezone.now() + timedelta(seconds=1) for e in stored)
    assert {(e.subject, e.to_state, e.actor_type, e.actor) for e in stored} == {
        ("payment_attempt", "succeeded", "system", "settlement")
    }


def test_a_batch_past_the_copy_threshold_commits_with_its_transaction():
    purchase = PurchaseFactory.create()
    actor = Actor.system("settlement")

    def record() -> None:
        with events_batched():
            for i in range(COPY_FROM + 50):
                event_record(subject="note", actor=actor, purchase=purchase, evidence={"i": i})

    with pytest.raises(RuntimeError), transaction.atomic():
        record()
        raise RuntimeError("the change they record failed")
    assert not PurchaseEvent.objects.filter(purchase=purchase, subject="note").exists()
    with transaction.atomic():
        record()
    stored = PurchaseEvent.objects.filter(purchase=purchase, subject="note").order_by("pk")
    assert [e.evidence["i"] for e in stored] == list(range(COPY_FROM + 50))
