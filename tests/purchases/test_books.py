"""The books of a closed period: sales timed by their block, per offering, refunds and
credits, the relayer's gas (none in facilitator mode), self-payments flagged and kept out of
revenue, prepaid held apart from consumed; recorded with its SHA-256, and byte-identical when
exported again. Real PostgreSQL; the chain's own figures are compared in
tests/x402/test_books_chain.py."""

from __future__ import annotations

import csv
import hashlib
import io
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from backoffice.books import Period, PeriodInvalid
from backoffice.books_export import books_export
from doors.rest.prepaid_answers import PrepaidAnswers
from payments.models import ExportBatch, PaymentAttempt, RelayerAccount
from purchases.models import Purchase, Quote
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from purchases.services.quote.quotes import quote_create
from tests.conftest import CSV_INPUT
from tests.factories import OfferingFactory, PaymentAttemptFactory, RefundFactory
from tests.fixtures.anvil import closed_port_url

pytestmark = [pytest.mark.django_db]

NETWORK = "eip155:31337"
RELAYER = "0x" + "1e" * 20
FACILITATOR = "0x" + "fa" * 20
TREASURY = "0x" + "7e" * 20  # the seller's own wallet, listed in settings
NOVEMBER = Period.month("2026-11")
AFTER = datetime(2026, 12, 2, tzinfo=UTC)  # the clock, injected: November is closed


def _at(day: int, hour: int) -> datetime:
    return datetime(2026, 11, day, hour, tzinfo=UTC)


def _sale(offering: Any, *, payer: str, block_at: datetime, sent_by: str, **fields: Any) -> Any:
    attempt = PaymentAttemptFactory.create(
        purchase__quote__offering=offering, payer=payer, succeeded=True, **fields
    )
    PaymentAttempt.objects.filter(pk=attempt.pk).update(
        block_at=block_at, block_number=100 + attempt.pk, gas_used=80_000,
        effective_gas_price=1_000_000_000, sent_by=sent_by, final_at=block_at,
    )  # fmt: skip
    attempt.refresh_from_db()
    return attempt


@pytest.fixture
def november(settings: Any) -> dict[str, Any]:
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "SELLER_WALLETS": [TREASURY]}
    RelayerAccount.objects.create(network=NETWORK, address=RELAYER)
    report = OfferingFactory.create(slug="report", price=250_000)
    lookup = OfferingFactory.create(slug="lookup", price=1_000_000)
    buyer_1, buyer_2 = "0x" + "b1" * 20, "0x" + "b2" * 20
    paid = _sale(report, payer=buyer_1, block_at=_at(3, 10), sent_by=RELAYER)
    facilitated = _sale(lookup, payer=buyer_2, block_at=_at(3, 12), sent_by=FACILITATOR)
    own = _sale(report, payer=TREASURY, block_at=_at(4, 9), sent_by=RELAYER)
    december = _sale(report, payer=buyer_1, block_at=datetime(2026, 12, 1, tzinfo=UTC),
                     sent_by=RELAYER)  # fmt: skip
    refund = RefundFactory.create(payment_attempt=paid, amount=100_000, paid=True,
                                  paid_reference="0x" + "ab" * 32)  # fmt: skip
    RefundFactory.create(paid=True, payment_attempt=december, reason_code="other")
    type(refund).objects.filter(pk=refund.pk).update(paid_at=_at(5, 8))
    return {"paid": paid, "facilitated": facilitated, "own": own, "december": december}


def _rows(content: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(content.decode())))


def test_a_month_per_row_and_per_offering_with_gas_refunds_self_payments_and_net(november):
    export = books_export(period=NOVEMBER, created_by="finance", now=AFTER)
    rows = _rows(export.content)
    sales = [r for r in rows if r["record"] == "sale"]
    assert [(r["time_utc"], r["offering"], r["revenue"], r["excluded"], r["self_payment"])
            for r in sales] == [
        ("2026-11-03T10:00:00Z", "report", "0.250000", "0.000000", "no"),
        ("2026-11-03T12:00:00Z", "lookup", "1.000000", "0.000000", "no"),
        ("2026-11-04T09:00:00Z", "report", "0.000000", "0.250000", "yes"),
    ]  # fmt: skip
    # Gas: what the relayer paid (80k gas at 1 gwei), none when a facilitator sent it.
    assert [(r["gas"], r["gas_symbol"]) for r in sales] == [
        ("0.000080000000000000", "ETH"), ("", "ETH"), ("0.000080000000000000", "ETH")
    ]  # fmt: skip
    assert "facilitator" in sales[1]["note"] and "own wallet" in sales[2]["note"]
    assert all(r["asset_symbol"] == "USDC" for r in sales)
    (refund,) = [r for r in rows if r["record"] == "refund"]
    assert (refund["time_utc"], refund["refunds"], refund["net"]) == (
        "2026-11-05T08:00:00Z", "0.100000", "-0.100000"
    )  # fmt: skip
    per_offering = {r["offering"]: r for r in rows if r["record"] == "offering_total"}
    assert {k: (v["revenue"], v["refunds"], v["excluded"], v["net"], v["gas"])
            for k, v in per_offering.items()} == {
        "lookup": ("1.000000", "0.000000", "0.000000", "1.000000", "0.000000000000000000"),
        "report": ("0.250000", "0.100000", "0.250000", "0.150000", "0.000160000000000000"),
    }  # fmt: skip
    (total,) = [r for r in rows if r["record"] == "total"]
    assert (total["revenue"], total["refunds"], total["net"]) == (
        "1.250000", "0.100000", "1.150000"
    )  # fmt: skip
    notes = " | ".join(r["note"] for r in rows if r["record"] == "note")
    assert f"{NETWORK}: settled by a facilitator (facilitator mode): no gas of ours" in notes
    assert "seller's own wallets: 1, excluded from revenue" in notes
    # December's sale and its refund are in no November row.
    assert november["december"].purchase.ref not in export.content.decode()


def test_a_re_export_of_a_closed_period_is_byte_identical_and_recorded_with_its_sha256(november):
    first = books_export(period=NOVEMBER, created_by="finance", now=AFTER)
    again = books_export(period=NOVEMBER, created_by="auditor", now=AFTER + timedelta(days=40))
    assert again.content == first.content
    batches = list(ExportBatch.objects.filter(kind="books").order_by("pk"))
    assert [b.sha256 for b in batches] == [hashlib.sha256(first.content).hexdigest()] * 2
    assert batches[0].filters == {"period_start": "2026-11-01T00:00:00Z",
                                  "period_end": "2026-12-01T00:00:00Z",
                                  "include_self_payments": False}  # fmt: skip
    assert batches[0].row_count == len(_rows(first.content))
    assert (batches[0].first_created_at, batches[0].last_created_at) == (_at(3, 10), _at(5, 8))


def test_self_payments_count_as_revenue_only_when_asked(november):
    export = books_export(
        period=NOVEMBER, created_by="finance", include_self_payments=True, now=AFTER
    )
    (total,) = [r for r in _rows(export.content) if r["record"] == "total"]
    assert (total["revenue"], total["excluded"]) == ("1.500000", "0.000000")


def test_a_period_not_closed_yet_is_refused_and_nothing_is_recorded(november):
    with pytest.raises(PeriodInvalid, match="not closed"):
        books_export(period=NOVEMBER, created_by="finance", now=_at(30, 23))
    assert not ExportBatch.objects.exists()


def test_prepaid_deposits_held_apart_from_consumption_earned(buyer, offering):
    # `buyer` was topped up 10 USDC; it buys once, and that is consumption (earned).
    quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=CSV_INPUT).quote
    purchase_pay_prepaid(answers=PrepaidAnswers(), buyer=buyer, quote_id=quote.public_id,
                         payment_id="books-prepaid-0001")  # fmt: skip
    today = timezone.now().date()
    period = Period.days(today, today)
    export = books_export(period=period, created_by="finance", now=period.end)
    rows = _rows(export.content)
    held = {r["record"]: r["held"] for r in rows if r["record"].startswith("prepaid_")}
    assert held == {
        "prepaid_held_opening": "0.000000",
        "prepaid_deposits": "10.000000",
        "prepaid_consumed": "-0.250000",
        "prepaid_credits": "0.000000",
        "prepaid_adjustments": "0.000000",
        "prepaid_held_closing": "9.750000",
    }
    (sale,) = [r for r in rows if r["record"] == "sale"]
    assert (sale["rail"], sale["revenue"], sale["gas"], sale["gas_symbol"]) == (
        "prepaid", "0.250000", "", ""
    )  # fmt: skip


def test_the_command_writes_the_file_and_records_the_batch(november, tmp_path, capsys):
    target = tmp_path / "books.csv"
    call_command("books_export", "--month", "2026-11", "-o", str(target), "--by", "cron")
    batch = ExportBatch.objects.get(kind="books")
    assert hashlib.sha256(target.read_bytes()).hexdigest() == batch.sha256
    assert batch.created_by == "cron" and batch.sha256 in capsys.readouterr().err
    this_month = timezone.now().strftime("%Y-%m")
    with pytest.raises(CommandError, match="not closed"):
        call_command("books_export", "--month", this_month)


def test_finance_downloads_a_period_from_the_admin_and_support_may_not(november, settings):
    url = reverse("admin:payments_exportbatch_books")
    finance, support = _staff("finance"), _staff("support")
    assert finance.get(url).status_code == 200
    answer = finance.post(url, {"first_day": date(2026, 11, 1), "last_day": date(2026, 11, 30)})
    assert answer.status_code == 200, answer.content[:500]
    assert answer["Content-Disposition"].startswith('attachment; filename="books-20261101')
    assert answer.streaming
    downloaded = b"".join(answer.streaming_content)  # type: ignore[attr-defined]
    batch = ExportBatch.objects.get(kind="books")  # recorded once the last chunk went out
    assert batch.sha256 == hashlib.sha256(downloaded).hexdigest()
    assert batch.created_by == "finance"
    still_open = finance.post(url, {"month": timezone.now().strftime("%Y-%m")})
    assert still_open.status_code == 200 and b"the period is not closed" in still_open.content
    for hostile in ({"month": "9999-12"}, {"month": "2026-13"}, {"month": "x"}, {"month": ""}):
        refused = finance.post(url, hostile)
        assert refused.status_code == 200 and b"errorlist" in refused.content, hostile
    assert support.get(url).status_code == 403
    assert ExportBatch.objects.filter(kind="books").count() == 1


def _staff(username: str) -> Client:
    from django.contrib.auth.models import Group, User

    from backoffice.roles import roles_ensure

    roles_ensure()
    user = User.objects.create_user(username, is_staff=True)
    user.groups.add(Group.objects.get(name=username))
    client = Client()
    client.force_login(user)
    return client


def test_the_dashboard_charts_revenue_refunds_and_gas_per_day(settings):
    RelayerAccount.objects.create(network=NETWORK, address=RELAYER)
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "SELLER_WALLETS": [TREASURY]}
    offering = OfferingFactory.create(slug="report", price=250_000)
    yesterday = timezone.now() - timedelta(days=1)
    paid = _sale(offering, payer="0x" + "b1" * 20, block_at=yesterday, sent_by=RELAYER)
    _sale(offering, payer=TREASURY, block_at=yesterday, sent_by=RELAYER)  # not revenue
    refund = RefundFactory.create(payment_attempt=paid, amount=100_000, paid=True)
    type(refund).objects.filter(pk=refund.pk).update(paid_at=yesterday)
    page = _staff("finance").get(reverse("admin:purchases_purchase_dashboard")).content.decode()
    day = yesterday.astimezone(UTC).strftime("%Y-%m-%d")
    for series, value in (("revenue", "0.25"), ("refunds", "0.1"), ("gas", "0.00016")):
        assert f'data-series="{series}" data-day="{day}" data-value="{value}"' in page, series
    assert "revenue and refunds per day (USDC)" in page and "gas per day (ETH)" in page
    assert "<script" not in page.split('data-testid="dash-money"')[1]


def test_a_settlement_whose_block_the_chain_cannot_tell_is_awaited_never_guessed(
    november, settings
):
    settings.X402_NETWORKS = {
        **settings.X402_NETWORKS,
        NETWORK: {**settings.X402_NETWORKS[NETWORK], "rpc_url": closed_port_url()},
    }
    unread = PaymentAttemptFactory.create(
        purchase__quote__offering=november["paid"].purchase.offering, succeeded=True,
        tx_hash="0x" + "cd" * 32,
    )  # fmt: skip
    PaymentAttempt.objects.filter(pk=unread.pk).update(created_at=_at(20, 12))
    export = books_export(period=NOVEMBER, created_by="finance", now=AFTER)
    rows = _rows(export.content)
    assert unread.purchase.ref not in export.content.decode()
    notes = [r["note"] for r in rows if r["record"] == "note"]
    assert any(n.startswith("awaiting the chain: 1 settled payment(s)") for n in notes), notes
    assert PaymentAttempt.objects.get(pk=unread.pk).block_at is None


LARGE = 20_000


def _many_sales(offering: Any, count: int) -> None:
    """`count` settled sales in November, bulk-written: twenty share each block time, and
    their refs mix cases, so the file's order rests on the purchase ref compared byte-wise."""
    quotes = Quote.objects.bulk_create(
        Quote(offering=offering, quote_key=f"k{i}", canonical_input={}, input_hash="h",
              price=offering.price, asset=offering.asset, network=offering.network,
              pay_to=offering.pay_to, offering_version=1, expires_at=AFTER,
              public_id=f"qt_books{i}")
        for i in range(count)
    )  # fmt: skip
    purchases = Purchase.objects.bulk_create(
        Purchase(quote=q, offering=offering, amount=offering.price, asset=offering.asset,
                 network=offering.network, rail="x402", ref=f"pur_{'aB'[i % 2]}{count - i:06d}")
        for i, q in enumerate(quotes)
    )  # fmt: skip
    PaymentAttempt.objects.bulk_create(
        (PaymentAttempt(purchase=p, rail="x402", payer="0x" + "b3" * 20, network=p.network,
                        asset=p.asset, amount=p.amount, fingerprint=f"f{i}",
                        state=PaymentAttempt.State.SUCCEEDED, tx_hash=f"0xe{i:063x}",
                        block_at=_at(6 + i % 20, 10), block_number=1000 + i, final_at=AFTER,
                        gas_used=50_000, effective_gas_price=10**9, sent_by=RELAYER)
         for i, p in enumerate(purchases)),
        batch_size=5000,
    )  # fmt: skip


def test_a_large_period_streams_and_its_recorded_hash_is_of_the_bytes_downloaded(november):
    _many_sales(november["paid"].purchase.offering, LARGE)
    url = reverse("admin:payments_exportbatch_books")
    answer = _staff("finance").post(url, {"month": "2026-11"})
    assert answer.status_code == 200 and answer.streaming
    chunks = iter(answer.streaming_content)  # type: ignore[attr-defined]
    received = [next(chunks)]
    # Sent before the period was read to its end: nothing is recorded until the last byte.
    assert received[0].startswith(b"record,time_utc,")
    assert not ExportBatch.objects.filter(kind="books").exists()
    received += list(chunks)
    assert len(received) > LARGE // 1000  # many chunks, none holding the file
    content = b"".join(received)
    batch = ExportBatch.objects.get(kind="books")
    assert batch.sha256 == hashlib.sha256(content).hexdigest() and len(content) > 1_000_000
    rows = _rows(content)
    assert batch.row_count == len(rows)
    sales = [(r["time_utc"], r["purchase"]) for r in rows if r["record"] == "sale"]
    assert len(sales) == LARGE + 3
    assert sales == sorted(sales)  # merged from three cursors, in the file's order
    # The same bytes as the in-memory export of the same period.
    assert books_export(period=NOVEMBER, created_by="finance", now=AFTER).content == content


def test_an_x402_top_up_is_a_deposit_not_revenue_and_its_spending_is(settings):
    """An x402 top-up's settlement is held for the buyer (a deposit line, no revenue); the
    prepaid rows count it as a deposit, and only what the balance buys is earned."""
    RelayerAccount.objects.create(network=NETWORK, address=RELAYER)
    top_up = OfferingFactory.create(slug="top-up", top_up=True)
    report = OfferingFactory.create(slug="report", price=250_000)
    yesterday = timezone.now() - timedelta(days=1)
    deposit = _sale(top_up, payer="0x" + "b1" * 20, block_at=yesterday, sent_by=RELAYER)
    _sale(report, payer="0x" + "b2" * 20, block_at=yesterday, sent_by=RELAYER)
    day = yesterday.astimezone(UTC).date()
    export = books_export(period=Period.days(day, day), created_by="finance", now=timezone.now())
    rows = _rows(export.content)
    (line,) = [r for r in rows if r["record"] == "deposit"]
    assert (line["purchase"], line["revenue"], line["net"]) == (
        deposit.purchase.ref, "0.000000", "0.000000"
    )  # fmt: skip
    assert line["gas"] == "0.000080000000000000" and "prepaid top-up" in line["note"]
    (total,) = [r for r in rows if r["record"] == "total"]
    assert total["revenue"] == "0.250000"  # the report only
    page = _staff("finance").get(reverse("admin:purchases_purchase_dashboard")).content.decode()
    assert f'data-series="revenue" data-day="{day:%Y-%m-%d}" data-value="0.25"' in page
