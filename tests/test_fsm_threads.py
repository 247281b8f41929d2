"""A state field stays protected per thread while another thread reloads its row.

django-fsm's `refresh_from_db` lifts `protected` on the field object, which every thread
shares, for the length of the reload; with threads (gunicorn's gthread workers, the MCP
door's pool) one thread re-armed it in the middle of another's reload, which then failed
with "Direct state modification is not allowed": a 500 to an agent retrying its payment
(seen across hosts in `make bench-hosts`). core.fsm.FSMField keeps the lift per thread.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from payments.models import PaymentAttempt
from tests.factories import PaymentAttemptFactory

THREADS = 8
RELOADS = 150


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_threads_reloading_one_state_field_never_trip_its_protection() -> None:
    attempt = PaymentAttemptFactory.create()
    failures: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def reload_many() -> None:
        try:
            mine = PaymentAttempt.objects.get(pk=attempt.pk)
            start.wait()
            for _ in range(RELOADS):
                mine.refresh_from_db()
                mine.refresh_from_db(fields=["state", "tx_hash"])
        except BaseException as exc:
            failures.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=reload_many) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert failures == []
    # And the protection itself still holds, in this thread and after all those reloads.
    with pytest.raises(AttributeError, match="Direct state modification"):
        attempt.state = PaymentAttempt.State.SUCCEEDED


@pytest.mark.django_db
def test_a_reload_still_reads_the_state_written_underneath() -> None:
    attempt = PaymentAttemptFactory.create()
    PaymentAttempt.objects.filter(pk=attempt.pk).update(state=PaymentAttempt.State.FAILED)
    attempt.refresh_from_db()
    assert attempt.state == PaymentAttempt.State.FAILED
