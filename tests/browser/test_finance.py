"""Finance works the refund-owed list in the browser: pays back on chain evidence, confirms a
payback the watch found; support is refused finance actions."""

from __future__ import annotations

import csv
import io
from typing import Any

from django.urls import reverse

from devtools.situations import transfer_after_failure, two_authorizations_for_one_quote
from payments.models import Refund
from purchases.services.remedy.paybacks import refund_paybacks_watch
from tests.browser.conftest import BrowserWorld, screenshot
from tests.fixtures.anvil import erc20_transfer

# Local chain's finality policy (X402_LOCAL_FINALITY_DEPTH): blocks mined past a payback.
FINALITY_DEPTH = 3


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

    # A payback of the wrong amount is refused by its check's code; the right one closes.
    owed = Refund.objects.get(purchase__ref=late.purchase_ref)
    w3, seller = browser_world.node.w3(), browser_world.seller
    token = browser_world.stage.token
    short = erc20_transfer(w3, token, seller, owed.payer, owed.amount - 1)
    payback = erc20_transfer(w3, token, seller, owed.payer, owed.amount)
    browser_world.node.mine(FINALITY_DEPTH)
    finance.goto(refunds_url)
    finance.check(f"input.action-select[value='{owed.pk}']")
    _run_action(finance, "Mark paid back")
    finance.fill(f"input[name=reference_{owed.pk}]", short)
    finance.click("input[name=apply]")
    said = finance.locator("form .errorlist").inner_text()
    assert (
        "payback_wrong_amount: The transfer to the destination is not of the amount owed." in said
    )
    finance.fill(f"input[name=reference_{owed.pk}]", payback)
    screenshot(finance, "finance-mark-paid-back")
    finance.click("input[name=apply]")
    assert "Marked 1 refund(s) paid back." in finance.locator("ul.messagelist").inner_text()
    owed.refresh_from_db()
    assert (owed.state, owed.paid_reference, owed.paid_by) == ("paid", payback, "finance")
    still_owed = Refund.objects.get(purchase__ref=duplicate.purchase_ref)
    assert still_owed.state == "owed"

    # The duplicate is paid back without telling anyone: the watch finds it, finance confirms.
    erc20_transfer(w3, token, seller, still_owed.payer, still_owed.amount)
    browser_world.node.mine(FINALITY_DEPTH)
    assert refund_paybacks_watch()["matched"] == 1  # the beat job's pass, now
    finance.goto(refunds_url)
    row = finance.locator("#result_list tr", has_text=duplicate.purchase_ref)
    assert "match found: 0x" in row.inner_text()
    finance.check(f"input.action-select[value='{still_owed.pk}']")
    _run_action(finance, "Confirm payback found on chain")
    said = finance.locator("ul.messagelist").inner_text()
    assert "Confirmed 1 payback(s): refund(s) paid back." in said
    still_owed.refresh_from_db()
    assert still_owed.state == "paid"
    finance.goto(refunds_url + "?state=paid")
    assert payback in finance.locator("#result_list").inner_text()

    support = staff_page("support")
    support.goto(refunds_url)
    offered = support.locator("select[name=action] option").all_inner_texts()
    assert "Mark paid back" not in offered
    top_up = support.goto(reverse("admin:payments_ledgerentry_top_up"))
    assert top_up is not None and top_up.status == 403
