"""The /metrics scrape: gauges read from the database, exact values, few queries."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.test import Client
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from backoffice import metrics
from payments.models import PaymentAttempt
from purchases.models import Escalation, JobRun, Offering, OutboxMessage, Purchase
from purchases.services.checkout.idempotency import payment_id_conflicts
from tests.factories import (
    USDC_LOCAL,
    EscalationFactory,
    OfferingFactory,
    PaymentAttemptFactory,
    PurchaseFactory,
    RefundFactory,
)

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.metrics_urls")]

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
OTHER_ASSET = "0x" + "bb" * 20
PAY = Purchase.PaymentState
ATTEMPT = PaymentAttempt.State

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics.tollbooth_collector, "clock", lambda: NOW)


def scrape(client: Client, **headers: str) -> Samples:
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200
    assert response["Content-Type"] == CONTENT_TYPE_LATEST
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.content.decode())
        for s in family.samples
    }


def series(samples: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(k[1])[label]: v for k, v in samples.items() if k[0] == name}


def _purchase(offering: Offering, *, payment: str, fulfillment: str = "not_started") -> Purchase:
    return PurchaseFactory.create(
        quote__offering=offering,
        quote__expires_at=NOW + timedelta(minutes=15),
        payment_state=payment,
        fulfillment_state=fulfillment,
    )


def _attempt(
    purchase: Purchase, *, state: str, age: timedelta, broadcast: bool = False
) -> PaymentAttempt:
    attempt = PaymentAttemptFactory.create(
        purchase=purchase, state=state, broadcast_started_at=NOW - age if broadcast else None
    )
    # created_at is set on insert (auto_now_add): age the row afterwards.
    PaymentAttempt.objects.filter(pk=attempt.pk).update(created_at=NOW - age)
    return attempt


def _refund(attempt: PaymentAttempt, *, amount: int, asset: str, reason: str, state: str) -> None:
    RefundFactory.create(
        payment_attempt=attempt, amount=amount, asset=asset, reason_code=reason, state=state
    )


def _escalation(purchase: Purchase, *, owner: str, reason: str, due_in: timedelta) -> Escalation:
    return EscalationFactory.create(
        purchase=purchase, owner=owner, reason_code=reason, deadline_at=NOW + due_in
    )


def _job(job: str, *, started_ago: int, took: int | None, error: str = "") -> None:
    started_at = NOW - timedelta(seconds=started_ago)
    finished_at = None if took is None else started_at + timedelta(seconds=took)
    JobRun.objects.create(job=job, started_at=started_at, finished_at=finished_at, error=error)


@pytest.fixture
def world() -> None:
    offering = OfferingFactory.create()
    paid = _purchase(offering, payment=PAY.PAID, fulfillment="unknown")
    pending = _purchase(offering, payment=PAY.SETTLEMENT_PENDING)
    broadcasting = _purchase(offering, payment=PAY.PAYING)
    recorded_only = _purchase(offering, payment=PAY.PAYING, fulfillment="running")
    failed = _purchase(offering, payment=PAY.FAILED)
    _purchase(offering, payment=PAY.VOID, fulfillment="unknown")

    settled = _attempt(paid, state=ATTEMPT.SUCCEEDED, age=timedelta(hours=3), broadcast=True)
    _attempt(pending, state=ATTEMPT.SETTLEMENT_PENDING, age=timedelta(seconds=600))
    _attempt(broadcasting, state=ATTEMPT.RECORDED, age=timedelta(seconds=90), broadcast=True)
    # Older, but never broadcast: not a pending settlement, so not the oldest one either.
    _attempt(recorded_only, state=ATTEMPT.RECORDED, age=timedelta(seconds=5000))
    late = _attempt(failed, state=ATTEMPT.FAILED, age=timedelta(hours=5), broadcast=True)

    _refund(late, amount=250_000, asset=USDC_LOCAL, reason="late_settlement", state="owed")
    _refund(late, amount=1_000_000, asset=USDC_LOCAL, reason="other", state="owed")
    _refund(late, amount=7, asset=USDC_LOCAL, reason="paid_back", state="paid")
    _refund(settled, amount=123_456_789_012, asset=OTHER_ASSET, reason="dup", state="owed")

    _escalation(pending, owner="support", reason="a", due_in=-timedelta(seconds=1))
    _escalation(pending, owner="support", reason="b", due_in=timedelta(hours=1))
    # Due exactly now is not overdue yet.
    _escalation(pending, owner="finance", reason="c", due_in=timedelta(0))
    _escalation(failed, owner="finance", reason="d", due_in=-timedelta(hours=2))
    EscalationFactory.create(
        purchase=failed,
        owner="reconciliation",
        reason_code="e",
        deadline_at=NOW - timedelta(hours=9),
        resolved=True,
    )

    _job("reconcile", started_ago=300, took=10)
    _job("reconcile", started_ago=120, took=10, error="RPC timed out")
    _job("reconcile", started_ago=10, took=None)  # still running
    _job("sweep", started_ago=50, took=5, error="boom")  # never succeeded


def test_settlements_and_unknown_executions(client, world):
    samples = scrape(client)

    assert samples[("tollbooth_pending_settlements", ())] == 2.0
    assert samples[("tollbooth_oldest_pending_settlement_age_seconds", ())] == 600.0
    assert samples[("tollbooth_unknown_executions", ())] == 2.0


def test_purchases_by_payment_state_includes_zeros(client, world):
    samples = scrape(client)

    assert series(samples, "tollbooth_purchases_by_payment_state", "state") == {
        "unpaid": 0.0,
        "paying": 2.0,
        "settlement_pending": 1.0,
        "paid": 1.0,
        "failed": 1.0,
        "void": 1.0,
        "reversed": 0.0,
        "authorized": 0.0,
        "released": 0.0,
    }


def test_refunds_owed_per_asset_exclude_paid_ones(client, world):
    samples = scrape(client)

    assert series(samples, "tollbooth_refunds_owed", "asset") == {
        USDC_LOCAL: 2.0,
        OTHER_ASSET: 1.0,
    }
    assert series(samples, "tollbooth_refunds_owed_amount", "asset") == {
        USDC_LOCAL: 1_250_000.0,
        OTHER_ASSET: 123_456_789_012.0,
    }


def test_escalations_open_and_overdue_per_owner(client, world):
    samples = scrape(client)

    assert series(samples, "tollbooth_escalations_open", "owner") == {
        "buyer": 0.0,
        "reconciliation": 0.0,
        "support": 2.0,
        "finance": 2.0,
    }
    assert series(samples, "tollbooth_escalations_overdue", "owner") == {
        "buyer": 0.0,
        "reconciliation": 0.0,
        "support": 1.0,
        "finance": 1.0,
    }


def test_job_lag_counts_from_the_last_success(client, world):
    samples = scrape(client)

    # reconcile last succeeded at NOW-290; sweep never did, and first tried at NOW-50.
    assert series(samples, "tollbooth_job_lag_seconds", "job") == {
        "reconcile": 290.0,
        "sweep": 50.0,
    }
    assert series(samples, "tollbooth_job_last_run_timestamp_seconds", "job") == {
        "reconcile": (NOW - timedelta(seconds=10)).timestamp(),
        "sweep": (NOW - timedelta(seconds=50)).timestamp(),
    }


def test_an_empty_database_exports_zeros_not_gaps(client):
    samples = scrape(client)

    assert samples[("tollbooth_pending_settlements", ())] == 0.0
    assert samples[("tollbooth_oldest_pending_settlement_age_seconds", ())] == 0.0
    assert samples[("tollbooth_unknown_executions", ())] == 0.0
    assert set(series(samples, "tollbooth_purchases_by_payment_state", "state").values()) == {0.0}
    assert set(series(samples, "tollbooth_escalations_overdue", "owner").values()) == {0.0}
    assert series(samples, "tollbooth_refunds_owed_amount", "asset") == {}
    assert series(samples, "tollbooth_job_lag_seconds", "job") == {}


def test_a_scrape_runs_eight_queries_whatever_the_row_count(
    client, world, django_assert_num_queries
):
    # Six, the relayer gas readings' one (issue 35) and the webhooks' one (issue 33).
    with django_assert_num_queries(8):
        scrape(client)


def test_process_metrics_and_the_conflicts_counter_come_along(client):
    scope = f"metrics-{uuid.uuid4().hex[:8]}"
    payment_id_conflicts.labels(scope=scope).inc()

    samples = scrape(client)

    assert samples[("tollbooth_payment_identifier_conflicts_total", (("scope", scope),))] == 1.0
    assert any(name == "python_info" for name, _ in samples)


def test_a_token_guards_the_scrape_when_set(client, settings):
    settings.TOLLBOOTH_METRICS_TOKEN = "s3cret-token"

    missing = client.get("/metrics")
    wrong = client.get("/metrics", headers={"Authorization": "Bearer nope"})

    assert (missing.status_code, wrong.status_code) == (401, 401)
    assert missing["WWW-Authenticate"] == 'Bearer realm="metrics"'
    assert b"tollbooth_" not in missing.content + wrong.content
    samples = scrape(client, Authorization="Bearer s3cret-token")
    assert samples[("tollbooth_pending_settlements", ())] == 0.0


def test_only_reads_are_allowed(client: Any):
    assert client.post("/metrics").status_code == 405


@pytest.mark.django_db
def test_metrics_are_served_at_the_root_url(client) -> None:  # type: ignore[no-untyped-def]
    response = client.get("/metrics")
    assert response.status_code == 200
    assert b"tollbooth_pending_settlements" in response.content
    assert b"tollbooth_payment_identifier_conflicts_total" in response.content


def test_outbox_backlog_and_the_oldest_unrelayed_age(client):
    def message(n: int, created: timedelta, relayed: bool, retired: bool = False) -> None:
        OutboxMessage.objects.create(
            job="refund_alert",
            kwargs={"refund_id": n},
            created_at=NOW - created,
            available_at=NOW,
            relayed_at=NOW if relayed else None,
            retired_at=NOW if retired else None,
        )

    message(1, timedelta(seconds=900), relayed=True)  # sent: neither counted nor aged
    message(4, timedelta(seconds=600), relayed=False, retired=True)  # done inline: nor this
    message(2, timedelta(seconds=42), relayed=False)
    message(3, timedelta(seconds=7), relayed=False)

    samples = scrape(client)

    assert samples[("tollbooth_outbox_backlog", ())] == 2.0
    assert samples[("tollbooth_outbox_oldest_unrelayed_age_seconds", ())] == 42.0


def test_an_empty_outbox_exports_zeros(client):
    samples = scrape(client)

    assert samples[("tollbooth_outbox_backlog", ())] == 0.0
    assert samples[("tollbooth_outbox_oldest_unrelayed_age_seconds", ())] == 0.0
