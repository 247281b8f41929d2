"""The refund-request queue clicked in Chromium (issue 33, part 2): support opens a buyer's
request, presses Decide, denies one with a reason code and approves another; finance then
approves the refund the approval proposed, on the purchase page, as for any proposal. Each
page is read after the click, as the person reads it."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.urls import reverse

from backoffice.roles import roles_ensure
from payments.models import Refund
from purchases.models import RefundRequest
from purchases.services.remedy.refund_requests import refund_request_open
from tests.browser.conftest import VIEWPORT, staff_context
from tests.factories import BuyerFactory
from tests.purchases.test_refund_requests import settled_purchase


def _staff(username: str, group: str) -> str:
    user = User.objects.create_user(username=username, is_staff=True)
    user.groups.add(Group.objects.get(name=group))
    return username


def _asked(reason: str) -> RefundRequest:
    buyer = BuyerFactory.create()
    purchase = settled_purchase(buyer=buyer)
    return refund_request_open(
        purchase_id=purchase.pk,
        channel=RefundRequest.Channel.API_KEY,
        requested_by=buyer.ref,
        amount=250_000,
        reason=reason,
        idempotency_key="browser-refund-key-0001",
    ).request


def _decide(page: Any, request: RefundRequest, fill: Any) -> str:
    change = reverse("admin:purchases_refundrequest_change", args=[request.pk])
    page.goto(change)
    assert "Left to refund" in page.content()  # the case's facts beside the request
    with page.expect_navigation() as opened:
        page.click('[data-testid="refund-request-decide"]')
    assert opened.value.status == 200
    fill(page)
    with page.expect_navigation() as applied:
        page.click('[data-testid="refund-request-apply"]')
    assert applied.value.status == 200
    assert page.url.endswith(change), page.url
    return page.locator("ul.messagelist li").inner_text().strip()


@pytest.mark.django_db(transaction=True)
def test_support_denies_and_approves_by_clicking_and_finance_approves_the_refund(
    live_server_url: str, browser: Any
) -> None:
    roles_ensure()
    support = staff_context(browser, live_server_url, _staff("sue", "support"), VIEWPORT)
    finance = staff_context(browser, live_server_url, _staff("fin", "finance"), VIEWPORT)
    page = support.new_page()

    denied = _asked("It was slow.")

    def deny(form: Any) -> None:
        form.check("input[name=decision][value=deny]")
        form.select_option("select[name=denial_code]", "delivered_as_described")
        form.fill("textarea[name=note]", "Delivered within the stated time.")

    said = _decide(page, denied, deny)
    assert said == "Denied (delivered_as_described); the buyer reads the reason code."
    assert "denied (delivered_as_described)" in page.locator("div.field-buyer_status").inner_text()
    assert page.locator('[data-testid="refund-request-decide"]').count() == 0

    approved = _asked("The report came back empty.")
    said = _decide(page, approved, lambda form: form.check("input[name=decision][value=approve]"))
    refund = Refund.objects.get(purchase=approved.purchase)
    assert re.fullmatch(
        rf"Approved: refund {refund.pk} of 250000 is proposed; finance approves it and pays "
        r"it to the payer's wallet\.",
        said,
    ), said

    # Finance decides the proposal on the purchase page, as any other.
    finance_page = finance.new_page()
    purchase_page = reverse("admin:purchases_purchase_change", args=[approved.purchase_id])
    finance_page.goto(purchase_page)
    with finance_page.expect_navigation():
        finance_page.click('[data-testid="case-now"] [data-testid="case-action-approve_refund"]')
    finance_page.select_option("select[name=decision]", "approve")
    with finance_page.expect_navigation():
        finance_page.click('[data-testid="case-action-apply"]')
    said = finance_page.locator("ul.messagelist li").inner_text().strip()
    assert said == f"Refund {refund.pk} is now owed.", said
    refund.refresh_from_db()
    assert (refund.state, refund.payer) == (Refund.State.OWED, approved.purchase.payer)
    support.close()
    finance.close()
