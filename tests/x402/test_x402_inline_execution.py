"""A paid call for fast in-process work is answered with its result by the request itself:
no worker runs here at all, and the job staged for one finds nothing left to do."""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from fulfillment.models import ExecutionAttempt
from payments.models import PaymentAttempt
from purchases.models import OutboxMessage, Purchase
from purchases.services.execution import ExecutionOutcome, purchase_execute
from purchases.services.result_wait import listeners_close
from tests.x402.e2e import PRICE, X402World, ask, sign_payment

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def test_paid_call_answers_with_the_result_without_a_worker(
    x402_live_world: X402World, settings
) -> None:
    world, client = x402_live_world, APIClient()
    settings.X402_RESULT_WAIT_SECONDS = 30
    required = ask(client, world)
    payment = sign_payment(required.headers["PAYMENT-REQUIRED"], world.payers[0], None)
    try:
        paid = ask(client, world, payment=payment)
    finally:
        listeners_close()

    assert paid.status_code == 200, paid.content
    assert json.loads(paid.content)["title"] == "Sales"
    purchase = Purchase.objects.get()
    assert purchase.fulfillment_state == Purchase.FulfillmentState.SUCCEEDED
    assert PaymentAttempt.objects.get().state == PaymentAttempt.State.SUCCEEDED
    assert world.seller_balance() == PRICE
    attempt = ExecutionAttempt.objects.get()
    assert attempt.worker.startswith("web:")
    # The job was still staged for a worker (the guarantee if this process had died) ...
    assert OutboxMessage.objects.filter(dedup_key=f"purchase_execute:{purchase.pk}").exists()
    # ... and when a worker takes it, the claim lets nobody run the work again.
    assert purchase_execute(purchase_id=purchase.pk, worker="w1") == ExecutionOutcome.OBSERVED
    assert ExecutionAttempt.objects.count() == 1
