"""A public receipt fetch is on the timeline, bounded: the first fetch is noted, then at most
one note per purchase per RECEIPT_FETCH_NOTE_WINDOW, however many fetches, concurrent ones
included. Anyone holding the link can fetch a receipt; a GET must not grow the timeline."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from fulfillment import selectors as fulfillment_selectors
from fulfillment.models import Receipt
from purchases import event_subjects
from purchases.models import Purchase, PurchaseEvent
from purchases.services.fulfil.delivery import (
    RECEIPT_FETCH_NOTE_WINDOW,
    _receipt_fetch_note,
    receipt_public,
)
from tests.factories import PurchaseFactory
from tests.integration.helpers import race

WINDOW_SECONDS = int(RECEIPT_FETCH_NOTE_WINDOW.total_seconds())


def _receipt() -> Receipt:
    purchase = PurchaseFactory.create(executed=True)
    return Receipt.objects.create(
        purchase=purchase,
        payer=purchase.payer,
        amount=purchase.amount,
        asset=purchase.asset,
        network="prepaid",
        transaction="",
        body_sha256="ab" * 32,
        delivered_at=timezone.now(),
    )


def _fetches(purchase: Purchase) -> list[PurchaseEvent]:
    return list(purchase.events.filter(subject=event_subjects.RECEIPT_FETCHED).order_by("pk"))


@pytest.mark.embedded
@pytest.mark.django_db
def test_many_fetches_in_a_window_are_one_event_and_write_nothing_after_it() -> None:
    receipt = _receipt()
    client = APIClient()
    url = f"/api/v1/receipts/{receipt.public_id}"

    assert client.get(url).status_code == 200
    with CaptureQueriesContext(connection) as later:
        answers = [client.get(url) for _ in range(20)]

    assert {answer.status_code for answer in answers} == {200}
    assert answers[-1].json()["receipt"] == receipt.public_id
    [fetched] = _fetches(receipt.purchase)
    assert (fetched.actor_type, fetched.actor) == ("agent", "public")
    assert fetched.evidence == {
        "receipt": receipt.public_id,
        "previous_note_at": None,
        "window_seconds": WINDOW_SECONDS,
    }
    receipt.refresh_from_db()
    assert receipt.last_fetch_noted_at is not None
    # Each later fetch is one read: no INSERT, no UPDATE.
    statements = [query["sql"].lstrip().split()[0].upper() for query in later.captured_queries]
    assert statements == ["SELECT"] * 20


@pytest.mark.embedded
@pytest.mark.django_db
def test_a_fetch_after_the_window_is_noted_again_with_the_previous_note() -> None:
    receipt = _receipt()
    start = timezone.now()

    receipt_public(public_id=receipt.public_id, now=start)
    receipt_public(public_id=receipt.public_id, now=start + timedelta(minutes=1))
    receipt_public(public_id=receipt.public_id, now=start + RECEIPT_FETCH_NOTE_WINDOW / 2)
    receipt_public(
        public_id=receipt.public_id, now=start + RECEIPT_FETCH_NOTE_WINDOW - timedelta(seconds=1)
    )
    assert len(_fetches(receipt.purchase)) == 1

    receipt_public(public_id=receipt.public_id, now=start + RECEIPT_FETCH_NOTE_WINDOW)
    receipt_public(public_id=receipt.public_id, now=start + RECEIPT_FETCH_NOTE_WINDOW * 1.5)

    first, second = _fetches(receipt.purchase)
    assert first.evidence["previous_note_at"] is None
    assert second.evidence == {
        "receipt": receipt.public_id,
        "previous_note_at": start.isoformat(),
        "window_seconds": WINDOW_SECONDS,
    }
    receipt.refresh_from_db()
    assert receipt.last_fetch_noted_at == start + RECEIPT_FETCH_NOTE_WINDOW


@pytest.mark.sqlite_concurrency
@pytest.mark.django_db(transaction=True)
def test_concurrent_fetches_that_all_found_the_receipt_unnoted_write_one_event() -> None:
    receipt = _receipt()
    count, now = 12, timezone.now()
    all_read = threading.Barrier(count)

    def fetch(_: int) -> tuple[str, datetime | None]:
        # Every thread reads the receipt before any notes the fetch, so every one of them
        # decides a note is due and races to write it.
        found = fulfillment_selectors.receipt_get(public_id=receipt.public_id)
        assert found is not None
        all_read.wait(timeout=10)
        _receipt_fetch_note(found, now)
        return ("noted when read", found.last_fetch_noted_at)

    assert race(count, fetch) == [("noted when read", None)] * count
    assert len(_fetches(receipt.purchase)) == 1
    receipt.refresh_from_db()
    assert receipt.last_fetch_noted_at == now


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_requests_for_a_receipt_write_one_event() -> None:
    receipt = _receipt()
    count = 12

    def fetch(_: int) -> int:
        return int(APIClient().get(f"/api/v1/receipts/{receipt.public_id}").status_code)

    assert race(count, fetch) == [200] * count
    assert len(_fetches(receipt.purchase)) == 1
