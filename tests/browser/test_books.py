"""Finance closes yesterday's books in the browser: the dashboard charts revenue, refunds and
gas per day, and the period's export downloads from the finance admin, recorded with the
SHA-256 of the very file the browser saved."""

from __future__ import annotations

import csv
import hashlib
import io
from datetime import UTC, datetime, time, timedelta
from typing import Any

from django.urls import reverse
from django.utils import timezone

from payments.models import ExportBatch, PaymentAttempt, RelayerAccount
from tests.browser.conftest import BrowserWorld, screenshot
from tests.factories import OfferingFactory, PaymentAttemptFactory, RefundFactory


def _yesterdays_books(world: BrowserWorld) -> tuple[str, Any]:
    """Two sales settled yesterday by our relayer, one of them paid back yesterday."""
    yesterday = timezone.now().astimezone(UTC).date() - timedelta(days=1)
    noon = datetime.combine(yesterday, time(12), tzinfo=UTC)
    offering = OfferingFactory.create(slug="books-report", price=250_000, network="eip155:1")
    relayer = "0x" + "1e" * 20
    sold = []
    for hour in (9, 15):
        attempt = PaymentAttemptFactory.create(purchase__quote__offering=offering, succeeded=True)
        PaymentAttempt.objects.filter(pk=attempt.pk).update(
            block_at=noon.replace(hour=hour), block_number=hour, gas_used=100_000,
            effective_gas_price=2_000_000_000, sent_by=relayer, final_at=noon,
        )  # fmt: skip
        sold.append(attempt)
    RelayerAccount.objects.create(network="eip155:1", address=relayer)
    refund = RefundFactory.create(payment_attempt=sold[0], paid=True)
    type(refund).objects.filter(pk=refund.pk).update(paid_at=noon)
    return yesterday.isoformat(), sold


def test_finance_sees_the_money_chart_and_downloads_yesterdays_books(
    browser_world: BrowserWorld, staff_page: Any
) -> None:
    day, sold = _yesterdays_books(browser_world)
    finance = staff_page("finance")
    finance.goto(reverse("admin:purchases_purchase_dashboard"))
    chart = finance.locator("[data-testid=dash-money] svg")
    assert chart.is_visible()
    bar = chart.locator(f"rect[data-series=revenue][data-day='{day}']")
    assert bar.get_attribute("data-value") == "0.5"
    assert (
        chart.locator(f"rect[data-series=refunds][data-day='{day}']").get_attribute("data-value")
        == "0.25"
    )
    assert (
        chart.locator(f"rect[data-series=gas][data-day='{day}']").get_attribute("data-value")
        == "0.0004"
    )
    assert "revenue and refunds per day (USDC)" in (chart.text_content() or "")
    screenshot(finance, "finance-dashboard-money-chart")

    finance.click("text=Export a period's books")
    finance.fill("input[name=first_day]", day)
    finance.fill("input[name=last_day]", day)
    screenshot(finance, "finance-books-export")
    with finance.expect_download() as download:
        finance.click("input[type=submit]")
    saved = download.value.path().read_bytes()
    assert download.value.suggested_filename.startswith("books-")
    rows = list(csv.DictReader(io.StringIO(saved.decode())))
    (total,) = [r for r in rows if r["record"] == "total"]
    assert (total["revenue"], total["refunds"], total["net"], total["gas"]) == (
        "0.500000", "0.250000", "0.250000", "0.000400000000000000"
    )  # fmt: skip
    assert {r["purchase"] for r in rows if r["record"] == "sale"} == {a.purchase.ref for a in sold}
    batch = ExportBatch.objects.get(kind="books")
    assert batch.sha256 == hashlib.sha256(saved).hexdigest()
    assert batch.created_by == "finance"

    # Today is not over: the page refuses it and says why.
    finance.goto(reverse("admin:payments_exportbatch_books"))
    today = timezone.now().astimezone(UTC).date().isoformat()
    finance.fill("input[name=first_day]", today)
    finance.fill("input[name=last_day]", today)
    finance.click("input[type=submit]")
    assert "the period is not closed" in finance.locator("#content").inner_text()
    assert ExportBatch.objects.filter(kind="books").count() == 1
