"""Redis restarted mid-run loses every queued message: the database still knows what is
owed, and the next beat picks it all up. Real Redis, real worker, real beat."""

from __future__ import annotations

import subprocess

import pytest
from celery import Celery
from django.conf import settings

from doors.rest.prepaid_answers import PrepaidAnswers
from purchases.models import Purchase
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from purchases.services.quote.quotes import quote_create
from tests.conftest import CSV_INPUT
from tests.integration.helpers import free_port, redis_server, wait_for

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def test_queued_work_lost_in_a_redis_restart_is_picked_up_by_the_next_beat(
    buyer, offering, start_worker
):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    redis = redis_server(port)
    try:
        quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=CSV_INPUT).quote
        answer, _ = purchase_pay_prepaid(
            answers=PrepaidAnswers(),
            buyer=buyer,
            quote_id=quote.public_id,
            payment_id="redis-restart-0001",
        )
        purchase = Purchase.objects.get(ref=answer.purchase_ref)
        assert purchase.fulfillment_state == "queued"
        # The execution is enqueued on this Redis ...
        producer = Celery("producer", broker=url, set_as_current=False)  # leaves current_app alone
        producer.send_task(
            "purchases.tasks.purchase_execute_task",
            kwargs={"purchase_id": purchase.pk},
            queue=settings.CELERY_TASK_DEFAULT_QUEUE,
        )
        assert (
            int(
                subprocess.run(
                    ["redis-cli", "-p", str(port), "llen", settings.CELERY_TASK_DEFAULT_QUEUE],
                    capture_output=True,
                    check=True,
                ).stdout
            )
            == 1
        )
        # ... and Redis dies before any worker took it. It keeps nothing on disk.
        redis.kill()
        redis.wait(timeout=10)
        redis = redis_server(port)
        assert (
            int(
                subprocess.run(
                    ["redis-cli", "-p", str(port), "llen", settings.CELERY_TASK_DEFAULT_QUEUE],
                    capture_output=True,
                    check=True,
                ).stdout
            )
            == 0
        )
        start_worker(
            "beat-worker",
            beat=True,
            extra_env={
                "REDIS_URL": url,
                "TOLLBOOTH_SWEEP_EVERY_SECONDS": "1",
                "TOLLBOOTH_SWEEP_GRACE_SECONDS": "0",
            },
        )
        wait_for(
            lambda: Purchase.objects.get(pk=purchase.pk).fulfillment_state == "succeeded",
            timeout=60,
            message="the next beat to pick the purchase up",
        )
        assert purchase.execution_attempts.count() == 1
    finally:
        redis.kill()
        redis.wait(timeout=10)
