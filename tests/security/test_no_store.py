"""Paid answers, purchase state, results, receipts, 402s and problems are never cached."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from purchases.models import Purchase
from purchases.services.fulfil.execution import ExecutionOutcome, purchase_execute
from tests.conftest import CSV_INPUT

pytestmark = pytest.mark.django_db


def test_every_answer_about_a_purchase_says_no_store(client_for_buyer, offering):
    quote = client_for_buyer.post(
        "/api/v1/quotes", {"offering": offering.slug, "input": CSV_INPUT}, format="json"
    )
    paid = client_for_buyer.post(
        f"/api/v1/quotes/{quote.json()['id']}/purchase",
        {"rail": "prepaid"},
        format="json",
        HTTP_IDEMPOTENCY_KEY="no-store-key-000001",
    )
    ref = paid.json()["purchase"]
    pending = client_for_buyer.get(f"/api/v1/purchases/{ref}/result")
    assert pending.status_code == 202
    purchase = Purchase.objects.get(ref=ref)
    assert purchase_execute(purchase_id=purchase.pk, worker="test") == ExecutionOutcome.SUCCEEDED
    result = client_for_buyer.get(f"/api/v1/purchases/{ref}/result")
    status = client_for_buyer.get(f"/api/v1/purchases/{ref}")
    receipt = APIClient().get(status.json()["links"]["receipt"])
    problem = client_for_buyer.get("/api/v1/purchases/pur_missing")
    unauthenticated = APIClient().get("/api/v1/balance")
    answers = [quote, paid, pending, result, status, receipt, problem, unauthenticated]
    assert [a.status_code for a in answers] == [201, 201, 202, 200, 200, 200, 404, 401]
    for answer in answers:
        assert answer["Cache-Control"] == "no-store", answer.request["PATH_INFO"]


def test_x402_answers_say_no_store(offering):
    unpaid = APIClient().post(f"/x402/{offering.slug}", CSV_INPUT, format="json")
    malformed = APIClient().post(
        f"/x402/{offering.slug}", {}, format="json", HTTP_PAYMENT_SIGNATURE="not base64 json"
    )
    assert [unpaid.status_code, malformed.status_code] == [402, 400]
    assert unpaid["Cache-Control"] == malformed["Cache-Control"] == "no-store"
