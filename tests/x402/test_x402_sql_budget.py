"""SQL budget of one paid x402 request on PostgreSQL (chain RPC calls are not SQL)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import TestCase
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from purchases.models import OutboxMessage, PurchaseEvent
from purchases.services.fulfil.result_wait import listeners_close
from tests.x402.e2e import ask, sign_payment

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]
# Measured after each step of the redesign (issue 9): lower it as statements go, never raise
# it. The target is 15. Transaction control (SAVEPOINT pairs in tests) is not counted.
# Since issue 22 the count includes what runs after the commit: the outbox's relayed mark
# (one UPDATE after the broker publish of the execution job) always ran, uncounted: 15 -> 16.
# Issue 22 §4: the anonymous quote is written with the purchase (one INSERT for the UPDATE
# that accepted it) and its terms, duplicate and payer's owner come with the offering's read
# (no quote read of its own): 16 -> 15.
CEILING = 15
# The same request answered with the result of fast work it ran itself, with its commits
# (on_commit runs): the 15 above, the execution's claim (4) and finish (5), the retirement
# of its execution job (which replaced the immediate relay's UPDATE: 29 both before and
# after, and no broker publish), the wait's state read and the delivery (3): 29 through
# Django's cursor. Production (CONN_HEALTH_CHECKS) sends one more per request on a reused
# connection: the health check's `SELECT 1`, run through the driver where Django's query
# log (and so this count) cannot see it. Counted from PostgreSQL's side that is 30, the
# figure docs/benchmarks.md gives; the ceiling is stated as that.
# An inline run that succeeded hands back the purchase as it committed it (succeeded), with
# the result and receipt it stored: the wait's state read, the answer's re-read of the
# purchase and its read of the result are gone. Counted before that: 28 through Django (the
# ceiling of 30 was one above it); now 25, 26 from PostgreSQL's side.
HEALTH_CHECK = 1
INLINE_CEILING = 26
_CONTROL = ("SAVEPOINT", "RELEASE SAVEPOINT", "ROLLBACK TO SAVEPOINT", "BEGIN", "COMMIT")


def test_paid_x402_request_statement_budget(x402_world):
    client = APIClient()
    payment = sign_payment(ask(client, x402_world)["PAYMENT-REQUIRED"], x402_world.payers[0], None)
    # The test's transaction never commits: its on_commit callbacks run here, inside the count.
    with (
        CaptureQueriesContext(connection) as captured,
        TestCase.captureOnCommitCallbacks(execute=True),
    ):
        paid = ask(client, x402_world, payment=payment)
    assert paid.status_code == 202, paid.content
    statements = [q["sql"] for q in captured.captured_queries if not q["sql"].startswith(_CONTROL)]
    assert len(statements) <= CEILING, "\n".join(statements)
    # The first broadcast is on the timeline within that count (it joins the batched INSERT).
    assert PurchaseEvent.objects.filter(subject="payment_attempt.broadcast").count() == 1


@pytest.mark.django_db(transaction=True)
def test_paid_x402_request_with_inline_work_statement_budget(x402_live_world, settings):
    settings.X402_RESULT_WAIT_SECONDS = 30
    client = APIClient()
    required = ask(client, x402_live_world)["PAYMENT-REQUIRED"]
    payment = sign_payment(required, x402_live_world.payers[0], None)
    try:
        with CaptureQueriesContext(connection) as captured:
            paid = ask(client, x402_live_world, payment=payment)
    finally:
        listeners_close()
    assert paid.status_code == 200, paid.content
    statements = [q["sql"] for q in captured.captured_queries if not q["sql"].startswith(_CONTROL)]
    assert len(statements) + HEALTH_CHECK <= INLINE_CEILING, "\n".join(statements)
    outbox_updates = [s for s in statements if s.startswith('UPDATE "purchases_outboxmessage"')]
    assert len(outbox_updates) == 1 and '"retired_at"' in outbox_updates[0]
    assert OutboxMessage.objects.get().status == "retired"
