"""Finance works the refund-owed list in the browser; support is refused finance actions."""

from __future__ import annotations

import csv
import io
from typing import Any

from django.urls import reverse

from devtools.situations import transfer_after_failure, two_authorizations_for_one_quote
from payments.models import Refund
from tests.browser.conftest import BrowserWorld, screenshot

PAYBACK_TX = "0x" + "ab" * 32


def _run_action(page: Any, action_label: str) -> None:
    page.select_option("select[name=action]", label=action_label)
    page.click("button[name=index]")


def test_finance_filters_exports_and_marks_one_paid_back_support_cannot(
    browser_world: BrowserWorld, staff_page: Any
) -> None:
    late = transfer_after_failure(browser_world.stage)
    duplicate = two_authorizations_for_one_quote(browser_world.stage)
    refunds_url = reverse("admin:payments_refund_changelist")
    finance = staff_page("finance")

    finance.goto(refunds_url)  # opens on the owed list
    listing = finance.locator("#result_list").inner_text()
    assert late.purchase_ref in listing and duplicate.purchase_ref in listing
    finance.locator("#changelist-filter a", has_text="late_settlement").click()
    filtered = finance.locator("#result_list").inner_text()
    assert late.purchase_ref in filtered and duplicate.purchase_ref not in filtered
    screenshot(finance, "finance-refunds-filtered")

    finance.goto(refunds_url)
    finance.check("#action-toggle")
    with finance.expect_download() as download:
        _run_action(finance, "Export CSV (recorded as a batch)")
    exported = download.value.path().read_text()
    rows = list(csv.DictReader(io.StringIO(exported)))
    assert {row["purchase"] for row in rows} == {late.purchase_ref, duplicate.purchase_ref}
    assert {row["reason"] for row in rows} == {"late_settlement", "duplicate_settlement"}

    owed = Refund.objects.get(purchase__ref=late.purchase_ref)
    finance.goto(refunds_url)
    finance.check(f"input.action-select[value='{owed.pk}']")
    _run_action(finance, "Mark paid back")
    finance.fill(f"input[name=reference_{owed.pk}]", PAYBACK_TX)
    screenshot(finance, "finance-mark-paid-back")
    finance.click("input[name=apply]")
    assert "Marked 1 refund(s) paid back." in finance.locator("ul.messagelist").inner_text()
    owed.refresh_from_db()
    assert (owed.state, owed.paid_reference, owed.paid_by) == ("paid", PAYBACK_TX, "finance")
    still_owed = Refund.objects.get(purchase__ref=duplicate.purchase_ref)
    assert still_owed.state == "owed"

    support = staff_page("support")
    support.goto(refunds_url)
    offered = support.locator("select[name=action] option").all_inner_texts()
    assert "Mark paid back" not in offered
    top_up = support.goto(reverse("admin:payments_ledgerentry_top_up"))
    assert top_up is not None and top_up.status == 403
