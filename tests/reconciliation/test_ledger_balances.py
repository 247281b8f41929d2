"""The running prepaid balance moves with every ledger entry, never overdraws under a race,
and reconciliation catches any difference from the append-only ledger."""

from __future__ import annotations

import pytest

from doors.rest.prepaid_answers import PrepaidAnswers
from payments.models import LedgerBalance, LedgerEntry
from payments.services import ledger_balance
from purchases.models import JobRun
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from purchases.services.jobs import housekeeping
from purchases.services.quote.quotes import quote_create
from tests.conftest import CSV_INPUT
from tests.factories import USDC_LOCAL, BuyerFactory, fund
from tests.integration.helpers import race


def _quote(buyer, offering, title: str) -> str:
    return quote_create(
        buyer=buyer, offering_slug=offering.slug, raw_input={**CSV_INPUT, "title": title}
    ).quote.public_id


@pytest.mark.django_db
def test_balance_follows_the_ledger_and_a_difference_is_reported(offering):
    buyer = BuyerFactory.create()
    fund(buyer, 600_000)
    answer, _ = purchase_pay_prepaid(
        answers=PrepaidAnswers(),
        buyer=buyer,
        quote_id=_quote(buyer, offering, "a"),
        payment_id="ledger-balance-0001",
    )
    assert answer.status == 201
    assert ledger_balance(buyer_id=buyer.pk, asset=USDC_LOCAL) == 600_000 - 250_000
    assert housekeeping.check_ledger_balances()["mismatched"] == 0

    LedgerBalance.objects.filter(buyer=buyer).update(amount=999)  # a hand edit
    stats = housekeeping.check_ledger_balances()
    assert stats["mismatched"] == 1
    assert stats[f"mismatch:{buyer.pk}:{USDC_LOCAL}"] == 999 - 350_000
    assert JobRun.objects.filter(job="ledger_balances").count() == 2


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_racing_payments_never_overdraw(offering):
    buyer = BuyerFactory.create()
    fund(buyer, 250_000)  # enough for exactly one
    quotes = [_quote(buyer, offering, f"race-{i}") for i in range(6)]
    answers = race(
        len(quotes),
        lambda i: purchase_pay_prepaid(
            answers=PrepaidAnswers(),
            buyer=buyer,
            quote_id=quotes[i],
            payment_id=f"ledger-race-{i:010d}",
        )[0],
    )
    statuses = [answer.status for answer in answers]
    assert sorted(statuses) == [201] + [402] * 5
    assert LedgerEntry.objects.filter(buyer=buyer, kind="purchase_debit").count() == 1
    assert ledger_balance(buyer_id=buyer.pk, asset=USDC_LOCAL) == 0
    assert housekeeping.check_ledger_balances()["mismatched"] == 0
