"""Payment-id leases renewed by their holder process's heartbeat, and given back when the
database returns (purchases/services/checkout/leases.py), on PostgreSQL and the SQLite file; and
which failures count as "the database is unreachable" (503) rather than a bug (500)."""

from __future__ import annotations

import sqlite3
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from django.db import utils as db_utils
from django.utils import timezone

from core.canonical import fingerprint
from core.outages import dependency_unreachable
from purchases.models import IdempotencyRecord
from purchases.services.checkout import leases
from purchases.services.checkout.idempotency import KeyedRequest, payment_id_claim
from tests.integration.helpers import free_port, wait_for

KEY = "lease-key-000000000001"


def _claim(principal: str = "buy_lease"):
    return payment_id_claim(
        request=KeyedRequest(
            scope="prepaid",
            key=KEY,
            principal=principal,
            fingerprint=fingerprint({"quote": "qt_lease", "rail": "prepaid"}),
            now=timezone.now(),
        )
    )


@pytest.fixture
def fast_beats(settings):
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "IDEMPOTENCY_HEARTBEAT": timedelta(seconds=0.1)}


@pytest.mark.sqlite_concurrency
@pytest.mark.django_db(transaction=True)
def test_a_held_lease_is_short_and_renewed_while_its_request_runs(fast_beats):
    claim = _claim()
    record = IdempotencyRecord.objects.get(pk=claim.record_id)
    assert claim.lease_token.startswith(leases._process.instance + ".")
    # 4 beats, not the 120 s lease: a dead holder's id is free within seconds.
    assert record.locked_until <= timezone.now() + timedelta(seconds=1)
    first = record.locked_until
    wait_for(
        lambda: IdempotencyRecord.objects.get(pk=claim.record_id).locked_until > first,
        timeout=10,
        message="the heartbeat to renew the lease",
    )
    leases.lease_done(token=claim.lease_token)


@pytest.mark.sqlite_concurrency
@pytest.mark.django_db(transaction=True)
def test_a_release_the_database_missed_is_sent_at_the_next_beat(fast_beats):
    claim = _claim()
    leases.lease_done(token=claim.lease_token)  # the request ended (its release failed)
    leases.lease_release_later(token=claim.lease_token, record_id=claim.record_id)
    wait_for(
        lambda: IdempotencyRecord.objects.get(pk=claim.record_id).locked_until is None,
        timeout=10,
        message="the owed release",
    )
    assert not leases._process.pending


@pytest.mark.django_db
def test_an_id_its_own_process_no_longer_holds_is_taken_over_at_once():
    first = _claim()
    leases.lease_done(token=first.lease_token)  # ended without storing or releasing
    again = _claim()
    assert again.replay is None and again.lease_token != first.lease_token
    leases.lease_done(token=again.lease_token)


def test_an_unreachable_postgresql_is_an_outage_a_deadlock_is_not():
    with pytest.raises(psycopg.OperationalError) as refused:
        psycopg.connect(host="127.0.0.1", port=free_port(), connect_timeout=2)
    assert dependency_unreachable(_wrapped(refused.value))
    assert dependency_unreachable(_wrapped(psycopg.errors.AdminShutdown()))
    assert not dependency_unreachable(_wrapped(psycopg.errors.DeadlockDetected()))
    assert not dependency_unreachable(_wrapped(psycopg.errors.SerializationFailure()))
    assert not dependency_unreachable(ValueError("a bug"))


def test_a_sqlite_file_locked_past_the_busy_timeout_is_an_outage(tmp_path: Path):
    path = tmp_path / "locked.sqlite3"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    waiter = sqlite3.connect(path, timeout=0, isolation_level=None)
    with pytest.raises(sqlite3.OperationalError) as locked:
        waiter.execute("INSERT INTO t VALUES (1)")
    assert dependency_unreachable(_wrapped(locked.value))
    with pytest.raises(sqlite3.OperationalError) as bad_sql:
        waiter.execute("SELECT nothing FROM nowhere")
    assert not dependency_unreachable(_wrapped(bad_sql.value))
    holder.close()
    waiter.close()


def _wrapped(cause: BaseException) -> db_utils.OperationalError:
    """As Django raises it: its own class, the driver's error as the cause."""
    assert isinstance(cause, psycopg.OperationalError | sqlite3.OperationalError)
    error = db_utils.OperationalError(*cause.args)
    error.__cause__ = cause
    return error


def test_outside_the_api_views_an_unreachable_database_is_a_503_too(rf):
    """handler500 (the admin, a middleware): the same answer as the API's."""
    from doors.rest.problems import server_error_view

    with pytest.raises(psycopg.OperationalError) as refused:
        psycopg.connect(host="127.0.0.1", port=free_port(), connect_timeout=2)
    try:
        raise _wrapped(refused.value)
    except db_utils.OperationalError:
        answer = server_error_view(rf.get("/admin/"))
    assert answer.status_code == 503
    assert answer["Retry-After"] == "5"
    assert answer["Content-Type"] == "application/problem+json"
    try:
        raise ValueError("a bug")
    except ValueError:
        assert server_error_view(rf.get("/admin/")).status_code == 500
