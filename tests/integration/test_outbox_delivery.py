"""The outbox delivers what the request path staged even when the immediate relay could
not: the broker was down at the commit, or the process died right after it. Real
PostgreSQL, a private Redis this test may kill, a real worker running beat's relay loop.
The sweeper's grace is set far out, so only the outbox can be what delivers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery
from django.conf import settings

from doors.rest.prepaid_answers import PrepaidAnswers
from purchases.models import JobRun, OutboxMessage, Purchase
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from purchases.services.quote.quotes import quote_create
from purchases.services.shared import outbox
from tests.conftest import CSV_INPUT
from tests.fixtures.worker import ROOT, _database_url
from tests.integration.helpers import free_port, redis_server, wait_for

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def _relay_worker_env(url: str) -> dict[str, str]:
    return {
        "REDIS_URL": url,
        "TOLLBOOTH_OUTBOX_RELAY_EVERY_SECONDS": "1",
        "TOLLBOOTH_SWEEP_GRACE_SECONDS": "3600",
    }


def _succeeded(purchase: Purchase) -> bool:
    return Purchase.objects.get(pk=purchase.pk).fulfillment_state == "succeeded"


def _deliver_with_broker_back(port: int, url: str, purchase: Purchase, start_worker) -> None:
    """The broker comes up, a worker with beat relays the outbox; wait for the work to finish."""
    redis = redis_server(port)
    try:
        start_worker("relay", beat=True, extra_env=_relay_worker_env(url))
        wait_for(lambda: _succeeded(purchase), timeout=60, message="the relay loop to deliver")
    finally:
        redis.kill()
        redis.wait(timeout=10)


def test_a_job_staged_while_the_broker_is_down_is_delivered_once_it_is_back(
    buyer, offering, start_worker, monkeypatch: pytest.MonkeyPatch
):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    # Not the current app: later tests would send to this dead broker.
    producer = Celery("web-process", broker=url, set_as_current=False)
    producer.conf.task_default_queue = settings.CELERY_TASK_DEFAULT_QUEUE
    monkeypatch.setattr(outbox, "_celery", lambda: producer)
    quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=CSV_INPUT).quote

    # Nothing listens on the port: the broker is down when the payment commits.
    answer, _ = purchase_pay_prepaid(
        answers=PrepaidAnswers(),
        buyer=buyer,
        quote_id=quote.public_id,
        payment_id="outbox-broker-down-0001",
    )

    purchase = Purchase.objects.get(ref=answer.purchase_ref)
    assert purchase.fulfillment_state == "queued"
    message = OutboxMessage.objects.get()
    assert (message.relayed_at, message.attempts) == (None, 1)
    assert "Connection refused" in message.last_error

    _deliver_with_broker_back(port, url, purchase, start_worker)

    message.refresh_from_db()
    assert message.relayed_at is not None
    assert message.attempts == 2
    assert purchase.execution_attempts.count() == 1
    assert JobRun.objects.filter(job="outbox_relay", stats__sent=1).count() == 1
    # Delivered by the outbox, not re-staged by the sweeper.
    assert not JobRun.objects.filter(job="executions", stats__re_enqueued__gt=0).exists()


# Pays in a process of its own that is SIGKILLed by its immediate relay: the payment has
# committed and nothing has reached the broker, as when a web process dies right there.
_DIES_AFTER_COMMIT = """
import os, signal, sys
import django
django.setup()
from purchases.models import Buyer
from purchases.services.shared import outbox
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from doors.rest.prepaid_answers import PrepaidAnswers
outbox._relay_staged = lambda **_: os.kill(os.getpid(), signal.SIGKILL)
purchase_pay_prepaid(
    buyer=Buyer.objects.get(pk=int(sys.argv[1])), quote_id=sys.argv[2],
    payment_id="outbox-killed-after-commit-01", answers=PrepaidAnswers(),
)
"""


def test_a_process_killed_between_commit_and_relay_has_its_job_delivered_by_the_loop(
    buyer, offering, start_worker, tmp_path: Path
):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=CSV_INPUT).quote
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings.test",
        "DATABASE_URL": _database_url(),
        "REDIS_URL": url,
        "TOLLBOOTH_CELERY_QUEUE": settings.CELERY_TASK_DEFAULT_QUEUE,
        "TOLLBOOTH_VAR_DIR": str(tmp_path / "var-web"),
        # The loop may take it at once: the process that owned it is gone.
        "TOLLBOOTH_OUTBOX_RELAY_GRACE_SECONDS": "0",
    }
    web = subprocess.run(
        [sys.executable, "-c", _DIES_AFTER_COMMIT, str(buyer.pk), quote.public_id],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )

    assert web.returncode == -signal.SIGKILL, web.stderr.decode()
    purchase = Purchase.objects.get(quote=quote)
    assert purchase.fulfillment_state == "queued"
    message = OutboxMessage.objects.get()
    assert (message.job, message.kwargs) == ("purchase_execute", {"purchase_id": purchase.pk})
    assert (message.relayed_at, message.attempts) == (None, 0)

    _deliver_with_broker_back(port, url, purchase, start_worker)

    message.refresh_from_db()
    assert message.relayed_at is not None
    assert message.attempts == 1
    assert purchase.execution_attempts.count() == 1
    assert not JobRun.objects.filter(job="executions", stats__re_enqueued__gt=0).exists()
