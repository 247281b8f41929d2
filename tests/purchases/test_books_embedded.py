"""The books on the embedded default too (issue 33, part 4): finance's dashboard and the books
export, with a chain refund paid back by the seller's wallet, on PostgreSQL and on SQLite
(`make test`'s second pass), through the admin and the command as finance uses them.

On SQLite both answered 500 before: the dashboard's payback gas read the payback's receipt
from its JSON with a type it could not compare ("malformed JSON"), and the export ordered by
PostgreSQL's "C" collation, which SQLite does not have ("no such collation sequence: C").
"""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from payments.models import PaymentAttempt, Refund, RelayerAccount
from tests.factories import OfferingFactory, PaymentAttemptFactory, RefundFactory

pytestmark = [pytest.mark.embedded, pytest.mark.django_db]

NETWORK = "eip155:31337"
RELAYER = "0x" + "1e" * 20
TREASURY = "0x" + "7e" * 20  # the seller's own wallet: it paid the refund back
PAYBACK_GAS_USED, PAYBACK_GAS_PRICE = 52_000, 2_000_000_000
SALE_GAS_USED, SALE_GAS_PRICE = 80_000, 1_000_000_000


def _staff(username: str) -> Client:
    from django.contrib.auth.models import Group, User

    from backoffice.roles import roles_ensure

    roles_ensure()
    user = User.objects.create_user(username, is_staff=True)
    user.groups.add(Group.objects.get(name=username))
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def paid_back(settings: Any) -> dict[str, Any]:
    """Yesterday: one sale settled by our relayer, and a refund of it paid back on chain from
    the seller's treasury, its receipt kept when the payback was verified."""
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "SELLER_WALLETS": [TREASURY]}
    RelayerAccount.objects.create(network=NETWORK, address=RELAYER)
    yesterday = (timezone.now() - timedelta(days=1)).astimezone(UTC).replace(hour=12)
    offering = OfferingFactory.create(slug="report", price=250_000)
    attempt = PaymentAttemptFactory.create(
        purchase__quote__offering=offering, payer="0x" + "b1" * 20, succeeded=True
    )
    PaymentAttempt.objects.filter(pk=attempt.pk).update(
        block_at=yesterday, block_number=100, gas_used=SALE_GAS_USED,
        effective_gas_price=SALE_GAS_PRICE, sent_by=RELAYER, final_at=yesterday,
    )  # fmt: skip
    payback_tx = "0x" + "ab" * 32
    refund = RefundFactory.create(
        payment_attempt=attempt, amount=100_000, paid=True, paid_reference=payback_tx
    )
    Refund.objects.filter(pk=refund.pk).update(
        paid_at=yesterday + timedelta(hours=1),
        payback_tx_hash=payback_tx,
        payback_log_index=0,
        payback_evidence={
            "tx_from": TREASURY,
            "gas_used": PAYBACK_GAS_USED,
            "effective_gas_price": PAYBACK_GAS_PRICE,
        },
    )
    return {"day": yesterday.date(), "payback_tx": payback_tx}


def test_the_dashboard_counts_the_payback_gas_for_finance_and_support(paid_back):
    day = paid_back["day"].strftime("%Y-%m-%d")
    gas = Decimal(SALE_GAS_USED * SALE_GAS_PRICE + PAYBACK_GAS_USED * PAYBACK_GAS_PRICE)
    for role in ("finance", "support"):
        response = _staff(role).get(reverse("admin:purchases_purchase_dashboard"))
        assert response.status_code == 200, role
        page = response.content.decode()
        if role == "finance":  # support sees no money chart
            value = f"{gas.scaleb(-18).normalize():f}"
            assert f'data-series="gas" data-day="{day}" data-value="{value}"' in page


def test_the_books_export_by_command_and_in_the_admin(paid_back, tmp_path):
    day = paid_back["day"]
    target = tmp_path / "books.csv"
    call_command("books_export", "--from", str(day), "--to", str(day), "-o", str(target))
    rows = list(csv.DictReader(io.StringIO(target.read_bytes().decode())))
    refund = next(row for row in rows if row["record"] == "refund")
    assert refund["transaction"] == paid_back["payback_tx"]
    assert Decimal(refund["gas"]) == Decimal(PAYBACK_GAS_USED * PAYBACK_GAS_PRICE).scaleb(-18)
    assert [row["record"] for row in rows].count("sale") == 1

    url = reverse("admin:payments_exportbatch_books")
    response = _staff("finance").post(url, {"first_day": str(day), "last_day": str(day)})
    assert response.status_code == 200
    downloaded = b"".join(response.streaming_content)  # type: ignore[attr-defined]
    assert downloaded == target.read_bytes()  # a re-export of a closed period: the same bytes


def test_a_period_ending_today_is_refused_clearly(paid_back):
    today = datetime.now(UTC).date()
    with pytest.raises(CommandError, match="not closed"):
        call_command("books_export", "--from", str(today), "--to", str(today))
