"""Expired unpaid quotes (one per anonymous 402) are purged on a schedule, in batches."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import DatabaseError, transaction
from django.utils import timezone
from rest_framework.test import APIClient

from doors.rest.prepaid_answers import PrepaidAnswers
from purchases.models import JobRun, Offering, Purchase, PurchaseEvent, Quote
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from purchases.services.jobs import housekeeping
from purchases.services.quote.quotes import quote_create
from tests.conftest import CSV_INPUT

pytestmark = pytest.mark.django_db


def keyed_quote(buyer, offering, title: str) -> Quote:
    data = {**CSV_INPUT, "title": title}
    return quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=data).quote


def test_expired_unpaid_quotes_are_purged_with_their_own_events_only(
    buyer, offering, db_is_postgres
):
    start = timezone.now()
    stale = keyed_quote(buyer, offering, "stale")
    # An anonymous 402 writes its quote only for an offering with stock (docs/x402.md).
    Offering.objects.filter(pk=offering.pk).update(stock=5)
    answer = APIClient().post(f"/x402/{offering.slug}", CSV_INPUT, format="json")
    Offering.objects.filter(pk=offering.pk).update(stock=None)
    assert answer.status_code == 402
    anonymous = Quote.objects.get(public_id=answer.json()["quote"])
    recent = keyed_quote(buyer, offering, "recent")
    Quote.objects.filter(pk=recent.pk).update(expires_at=start + timedelta(hours=25))
    paid = keyed_quote(buyer, offering, "paid")
    paid_answer, _ = purchase_pay_prepaid(
        answers=PrepaidAnswers(),
        buyer=buyer,
        quote_id=paid.public_id,
        payment_id="purge-test-payment-01",
    )
    assert paid_answer.status == 201
    open_quote = keyed_quote(buyer, offering, "open")
    Quote.objects.filter(pk=open_quote.pk).update(expires_at=start + timedelta(days=30))
    # Time is moved, not waited for: everything but the long-lived quote expires...
    housekeeping.expire_quotes(now=start + timedelta(hours=26))
    purchase = Purchase.objects.get(quote=paid)
    timeline = list(purchase.events.values_list("pk", flat=True))
    paid_quote_events = list(paid.events.values_list("pk", flat=True))
    purged_events = PurchaseEvent.objects.filter(quote__in=[stale, anonymous]).count()
    assert purged_events == 4  # opened and expired, each

    # ...and a day after expiry the unpaid ones go, one row per batch here.
    stats = housekeeping.purge_expired_quotes(now=start + timedelta(hours=26), batch=1)

    # The paid purchase's duplicate guard is a day old by then: pruned too.
    assert stats == {"purged": 2, "events_purged": 4, "guards_pruned": 1, "sign_ins_pruned": 0}
    assert set(Quote.objects.values_list("pk", flat=True)) == {recent.pk, paid.pk, open_quote.pk}
    assert not PurchaseEvent.objects.filter(quote_id__in=[stale.pk, anonymous.pk]).exists()
    assert list(purchase.events.values_list("pk", flat=True)) == timeline
    assert list(paid.events.values_list("pk", flat=True)) == paid_quote_events
    run = JobRun.objects.get(job="purge_quotes")
    assert (run.stats, run.error) == (
        {"purged": 2, "events_purged": 4, "guards_pruned": 1, "sign_ins_pruned": 0},
        "",
    )
    again = housekeeping.purge_expired_quotes(now=start + timedelta(hours=26))
    assert again == {"purged": 0, "events_purged": 0, "guards_pruned": 0, "sign_ins_pruned": 0}
    if db_is_postgres:  # a purchase's timeline is still append-only in the database
        with pytest.raises(DatabaseError), transaction.atomic():
            PurchaseEvent.objects.filter(purchase=purchase).delete()


def test_old_duplicate_guards_are_pruned_and_a_new_payment_recreates_its_own(
    buyer, offering, client_for_buyer
):
    from purchases.models import DuplicateGuard

    quote = keyed_quote(buyer, offering, "guarded")
    answer, _ = purchase_pay_prepaid(
        answers=PrepaidAnswers(),
        buyer=buyer,
        quote_id=quote.public_id,
        payment_id="guard-test-payment-01",
    )
    assert answer.status == 201
    DuplicateGuard.objects.create(key="f" * 64)
    DuplicateGuard.objects.filter(key="f" * 64).update(
        created_at=timezone.now() - timedelta(days=2)
    )
    stats = housekeeping.purge_expired_quotes()
    assert stats["guards_pruned"] == 1
    assert list(DuplicateGuard.objects.values_list("key", flat=True)) == [
        Purchase.objects.get().duplicate_key
    ]


def test_a_guard_outlives_the_longest_duplicate_window_so_a_retry_inside_it_is_still_caught(
    buyer, offering
):
    """A new guard means "no payment for this key to look for": pruning one while its
    purchase is still inside a (long) duplicate window would let a re-signed retry pay."""
    from purchases.models import DuplicateGuard

    offering.duplicate_window = timedelta(days=3)
    offering.save(update_fields=["duplicate_window"])
    quote = keyed_quote(buyer, offering, "long-window")
    first, _ = purchase_pay_prepaid(
        answers=PrepaidAnswers(),
        buyer=buyer,
        quote_id=quote.public_id,
        payment_id="long-window-payment-1",
    )
    assert first.status == 201
    two_days_ago = timezone.now() - timedelta(days=2)
    DuplicateGuard.objects.update(created_at=two_days_ago)
    Purchase.objects.update(created_at=two_days_ago)

    assert housekeeping.purge_expired_quotes()["guards_pruned"] == 0
    again = keyed_quote(buyer, offering, "long-window")
    retry, _ = purchase_pay_prepaid(
        answers=PrepaidAnswers(),
        buyer=buyer,
        quote_id=again.public_id,
        payment_id="long-window-payment-2",
    )
    assert (retry.status, retry.body["duplicate_of"]) == (200, first.purchase_ref)
    assert Purchase.objects.count() == 1
