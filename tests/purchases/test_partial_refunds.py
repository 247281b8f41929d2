"""Partial refunds, several against one payment, never more in all than it settled
(issue 21 §2): checked in the service under the payment's row lock, and raced for real."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, transaction
from django.utils import timezone

from payments.models import PaymentAttempt, Refund
from payments.services import (
    RefundExceedsSettled,
    refund_decide,
    refund_propose,
    refund_record,
    refund_refundable,
)
from tests.factories import PaymentAttemptFactory

SETTLED = 1_000_000


def _settled() -> PaymentAttempt:
    return PaymentAttemptFactory.create(succeeded=True, amount=SETTLED)


def _propose(attempt: PaymentAttempt, amount: int, reason: str) -> Refund:
    refund, _change = refund_propose(
        attempt=attempt, amount=amount, reason_code=reason, proposed_by="sam", note="partial"
    )
    return refund


@pytest.mark.django_db
def test_several_partial_refunds_add_up_to_what_was_settled_and_no_more() -> None:
    attempt = _settled()
    first = _propose(attempt, 400_000, "support_compensation")
    refund_decide(refund_id=first.pk, approve=True, by="fay", buyer_id=None, now=timezone.now())
    second = _propose(attempt, 400_000, "support_compensation")  # the first is decided
    assert second.pk != first.pk
    assert refund_refundable(attempt_id=attempt.pk) == (SETTLED, 200_000)
    with pytest.raises(RefundExceedsSettled, match="only 200000 of the 1000000"):
        _propose(attempt, 200_001, "support_refund")
    # A declined proposal returns nothing: its room is refundable again.
    refund_decide(refund_id=second.pk, approve=False, by="fay", buyer_id=None, now=timezone.now())
    assert refund_refundable(attempt_id=attempt.pk) == (SETTLED, 600_000)
    _propose(attempt, 600_000, "support_refund")
    assert refund_refundable(attempt_id=attempt.pk) == (SETTLED, 0)
    counted = Refund.objects.filter(payment_attempt=attempt).exclude(state="declined")
    assert sum(r.amount for r in counted) == SETTLED
    # The system's own refund of the same payment finds nothing left to owe.
    with pytest.raises(RefundExceedsSettled):
        refund_record(attempt=attempt, method="pay_back", reason_code="execution_failed")


@pytest.mark.django_db
def test_a_double_submit_is_the_same_open_proposal() -> None:
    attempt = _settled()
    first = _propose(attempt, 300_000, "support_compensation")
    again, change = refund_propose(
        attempt=attempt, amount=300_000, reason_code="support_compensation", proposed_by="sam",
        note="partial",
    )  # fmt: skip
    assert (again.pk, change) == (first.pk, None)


@pytest.mark.django_db
def test_the_systems_refund_owes_what_staff_refunds_left() -> None:
    attempt = _settled()
    _propose(attempt, 250_000, "support_compensation")
    refund, _changes = refund_record(
        attempt=attempt, method="pay_back", reason_code="execution_failed"
    )
    assert refund.amount == 750_000


def _waiting_on_locks() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return int(cursor.fetchone()[0])


# PostgreSQL only: two transactions racing on row locks, watched in pg_stat_activity.
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_proposals_racing_cannot_both_take_the_same_room() -> None:
    """Two staff propose 60% each at the same moment, from two connections: one is refused.

    The test holds the payment's row while both start, so both reach the check together:
    with the service's lock they queue on the row and the second sees the first's refund;
    without it both would read 100% refundable and both be proposed."""
    attempt = _settled()
    outcomes: dict[str, str] = {}
    connected = threading.Barrier(3)  # both threads connected, and the row held

    def propose(reason: str) -> None:
        try:
            connection.ensure_connection()
            connected.wait(timeout=60)
            _propose(attempt, 600_000, reason)
            outcomes[reason] = "proposed"
        except RefundExceedsSettled:
            outcomes[reason] = "refused"
        finally:
            connection.close()

    threads = [
        threading.Thread(target=propose, args=(reason,))
        for reason in ("support_refund", "support_compensation")
    ]
    for thread in threads:
        thread.start()
    with transaction.atomic():
        PaymentAttempt.objects.select_for_update().get(pk=attempt.pk)
        connected.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _waiting_on_locks() < 2 and len(outcomes) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)  # polling the database for both to queue, not timing them
        queued = _waiting_on_locks()
    for thread in threads:
        thread.join(timeout=30)
    assert queued == 2  # both reached the check while the row was held
    assert sorted(outcomes.values()) == ["proposed", "refused"]
    assert Refund.objects.filter(payment_attempt=attempt).count() == 1
    assert refund_refundable(attempt_id=attempt.pk) == (SETTLED, 400_000)
