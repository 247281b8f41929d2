"""A buyer pays from its balance while refunds of its failed purchases are credited to that
same balance: one lock order everywhere (core.locks), so no deadlock (issue 18, item 7).

Before, a capped buyer's payment locked the buyer row, then the balance; a refund credit
locked the balance, then (at COMMIT, Django's foreign keys being deferred) took FOR KEY SHARE
on the buyer row: each waited for the other and PostgreSQL killed one of them.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from django.db import connection

from doors.rest.prepaid_answers import PrepaidAnswers
from fulfillment.models import ExecutionAttempt
from payments.models import LedgerEntry, Refund
from payments.services import ledger_balance, ledger_balances_mismatched
from purchases.models import Purchase
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from purchases.services.fulfil.execution import ExecutionOutcome, purchase_execute
from purchases.services.quote.quotes import quote_create
from tests.factories import USDC_LOCAL, BuyerFactory, OfferingFactory, fund

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
PAYERS, PAYS_EACH, EXECUTORS = 3, 12, 3
START = 100_000_000


def _pay_loop(buyer, offering, thread: int, answers: list, errors: list) -> None:
    try:
        for i in range(PAYS_EACH):
            data = {"title": f"t{thread}-{i}"}  # no csv: the report executor refuses it
            quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=data).quote
            answer, _ = purchase_pay_prepaid(
                answers=PrepaidAnswers(),
                buyer=buyer,
                quote_id=quote.public_id,
                payment_id=f"lock-order-{thread:02d}-{i:04d}-key",
            )
            answers.append(answer.status)
    except BaseException as exc:
        errors.append(exc)
    finally:
        connection.close()


def _execute_loop(done: threading.Event, outcomes: Counter, errors: list, me: int) -> None:
    """A worker: run every queued purchase as it appears (the refund is credited then)."""
    try:
        while not done.is_set():
            queued = list(
                Purchase.objects.filter(fulfillment_state="queued")
                .order_by("?")
                .values_list("pk", flat=True)[:4]
            )
            for pk in queued:
                outcomes[purchase_execute(purchase_id=pk, worker=f"w{me}")] += 1
            if not queued:
                time.sleep(0.005)
    except BaseException as exc:
        errors.append(exc)
    finally:
        connection.close()


def test_pays_while_refunds_of_the_same_buyer_are_credited_never_deadlock():
    buyer = BuyerFactory.create(spend_cap=10**12)  # capped: its payments lock the buyer row
    fund(buyer, START)
    offering = OfferingFactory.create(input_schema={"type": "object"})
    answers: list[int] = []
    errors: list[BaseException] = []
    outcomes: Counter[str] = Counter()
    done = threading.Event()
    executors = [
        threading.Thread(target=_execute_loop, args=(done, outcomes, errors, n))
        for n in range(EXECUTORS)
    ]
    payers = [
        threading.Thread(target=_pay_loop, args=(buyer, offering, n, answers, errors))
        for n in range(PAYERS)
    ]
    for thread in [*executors, *payers]:
        thread.start()
    for thread in payers:
        thread.join(timeout=240)
    deadline = time.monotonic() + 120
    while (
        Purchase.objects.filter(fulfillment_state__in=("queued", "running")).exists()
        and not errors
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    done.set()
    for thread in executors:
        thread.join(timeout=60)
    assert not errors, [repr(e)[:300] for e in errors]  # no deadlock, in a pay or a worker
    assert answers == [201] * (PAYERS * PAYS_EACH)
    total = PAYERS * PAYS_EACH
    assert Purchase.objects.filter(fulfillment_state="failed").count() == total
    assert ExecutionAttempt.objects.filter(state="failed").count() == total
    assert Refund.objects.filter(state="paid", reason_code="execution_failed").count() == total
    assert set(outcomes) <= {ExecutionOutcome.FAILED, ExecutionOutcome.OBSERVED}
    assert outcomes[ExecutionOutcome.FAILED] == total
    # Every debit was credited back, exactly: the balance is where it started.
    assert ledger_balance(buyer_id=buyer.pk, asset=USDC_LOCAL) == START
    assert LedgerEntry.objects.filter(kind="purchase_debit").count() == total
    assert LedgerEntry.objects.filter(kind="refund_credit").count() == total
    assert ledger_balances_mismatched() == []
