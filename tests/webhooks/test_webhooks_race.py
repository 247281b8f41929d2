"""Two events of one purchase recorded at once, neither under the purchase's lock (an
escalation is resolved under its own): they take sequences 1 and 2, never one number twice."""

from __future__ import annotations

import threading

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from tests.factories import PurchaseFactory
from tests.integration.helpers import wait_for
from webhooks.events import webhook_event_record
from webhooks.models import WebhookEvent

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _waiting_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        )
        return bool(cursor.fetchone()[0])


def test_racing_events_of_one_purchase_take_consecutive_sequences():
    purchase = PurchaseFactory.create(paid=True)
    recorded, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def first() -> None:
        try:
            with transaction.atomic():
                webhook_event_record(
                    purchase_id=purchase.pk,
                    event_type="purchase.escalated",
                    reason_code="",
                    now=timezone.now(),
                )
                recorded.set()
                release.wait(timeout=30)  # holds its uncommitted sequence 1
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    def second() -> None:
        try:
            with transaction.atomic():
                webhook_event_record(
                    purchase_id=purchase.pk,
                    event_type="purchase.resolved",
                    reason_code="",
                    now=timezone.now(),
                )
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    one = threading.Thread(target=first)
    one.start()
    assert recorded.wait(timeout=30)
    two = threading.Thread(target=second)
    two.start()
    wait_for(_waiting_on_a_lock, message="the second INSERT waiting on the first's sequence")
    release.set()
    one.join(timeout=30)
    two.join(timeout=30)
    assert errors == []
    assert list(
        WebhookEvent.objects.filter(purchase=purchase)
        .order_by("sequence")
        .values_list("type", "sequence")
    ) == [("purchase.escalated", 1), ("purchase.resolved", 2)]


def test_the_database_refuses_one_sequence_twice():
    purchase = PurchaseFactory.create(paid=True)
    WebhookEvent.objects.create(
        purchase=purchase, type="purchase.paid", sequence=1, occurred_at=timezone.now()
    )
    with pytest.raises(IntegrityError), transaction.atomic():
        WebhookEvent.objects.create(
            purchase=purchase, type="purchase.failed", sequence=1, occurred_at=timezone.now()
        )
