"""Payout approvals racing for real (threads, each on its own PostgreSQL connection): the
day's cap holds under the day's row lock, the wallet's nonces stay distinct, and one refund
gets one payout however many people approve it at once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from django.db import connection

from core.actors import Actor
from core.errors import ErrorCode
from payments.models import Payout
from purchases.services.remedy.payouts import PayoutRefused, payout_day_used, refund_payout_approve
from tests.reconciliation.payout_world import add_refund_wallet
from tests.x402.e2e import NETWORK, PRICE, X402World

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def race(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run the calls at once, one thread each; their results or the exceptions raised."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(index: int) -> None:
        try:
            barrier.wait()
            results[index] = calls[index]()
        except Exception as exc:
            results[index] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_approvals_racing_never_pass_the_days_cap(
    x402_live_world: X402World, settings: Any
) -> None:
    payouts = add_refund_wallet(x402_live_world, settings, cap=3 * PRICE)
    refunds = [payouts.owed_refund(payer) for payer in x402_live_world.payers * 2]
    results = race(
        [
            partial(refund_payout_approve, refund_id=refund.pk, actor=Actor.staff(f"finance-{n}"))
            for n, refund in enumerate(refunds)
        ]
    )

    approved = [r for r in results if isinstance(r, Payout)]
    refused = [r for r in results if isinstance(r, PayoutRefused)]
    assert (len(approved), len(refused)) == (3, 3), results
    assert {r.code for r in refused} == {ErrorCode.PAYOUT_CAP_EXCEEDED}
    day = approved[0].cap_day
    assert payout_day_used(network=NETWORK, asset=x402_live_world.token, day=day) == 3 * PRICE
    # One nonce each, with no gap: the wallet row handed them out in turn.
    assert sorted(Payout.objects.values_list("nonce", flat=True)) == [0, 1, 2]


def test_one_refund_approved_at_once_by_several_people_gets_one_payout(
    x402_live_world: X402World, settings: Any
) -> None:
    payouts = add_refund_wallet(x402_live_world, settings)
    refund = payouts.owed_refund()
    results = race(
        [
            partial(refund_payout_approve, refund_id=refund.pk, actor=Actor.staff(f"f-{n}"))
            for n in range(4)
        ]
    )
    assert sum(isinstance(r, Payout) for r in results) == 1, results
    assert {r.code for r in results if isinstance(r, PayoutRefused)} == {
        ErrorCode.PAYOUT_NOT_PAYABLE
    }
    assert Payout.objects.count() == 1
