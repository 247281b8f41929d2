"""The refund list and the purchase page fit a 1366x768 support laptop: nothing scrolls
sideways, neither the page nor a table inside it, with the longest values they show
(wallets, tx hashes, pay-back references, facilitator reason codes) and the navigation
sidebar and the filters open."""

from __future__ import annotations

from typing import Any

from django.urls import reverse
from django.utils import timezone

from core.actors import Actor
from devtools.situations import transfer_after_failure, two_authorizations_for_one_quote
from payments.models import Refund
from purchases.models import Purchase
from purchases.services.remedies import purchase_refund_mark_paid
from tests.browser.conftest import BrowserWorld

LAPTOP = {"width": 1366, "height": 768}
PAYBACK_TX = "0x" + "ab" * 32

# Every table on the page, and its own scrolling wrapper when it has one (the list's
# `.results`): (what, content width, the width it has). A table wider than its box, or a
# wrapper that scrolls, is overflow even when the page itself does not scroll.
OVERFLOW = """() => {
  const found = [["page", document.documentElement.scrollWidth, window.innerWidth]];
  for (const table of document.querySelectorAll("#content table")) {
    const name = table.id || table.closest("[id]").id;
    const box = table.parentElement;
    found.push([name, Math.ceil(table.getBoundingClientRect().width), box.clientWidth]);
    found.push([name + " wrapper", box.scrollWidth, box.clientWidth]);
  }
  return found;
}"""


def overflowing(page: Any) -> list[list[Any]]:
    return [row for row in page.evaluate(OVERFLOW) if row[1] > row[2]]


def test_refund_list_and_purchase_page_fit_1366_pixels(
    browser_world: BrowserWorld, staff_page: Any
) -> None:
    late = transfer_after_failure(browser_world.stage)
    duplicate = two_authorizations_for_one_quote(browser_world.stage)
    # One refund paid back, so the list also shows a 66-character pay-back reference.
    paid = Refund.objects.get(purchase__ref=late.purchase_ref)
    purchase_refund_mark_paid(
        refund_id=paid.pk, reference=PAYBACK_TX, now=timezone.now(), actor=Actor.staff("finance")
    )
    pages = {
        "refunds owed": reverse("admin:payments_refund_changelist"),
        "all refunds": reverse("admin:payments_refund_changelist") + "?state=all",
    }
    for played in (late, duplicate):
        purchase = Purchase.objects.get(ref=played.purchase_ref)
        pages[played.situation] = reverse("admin:purchases_purchase_change", args=[purchase.pk])
    for role in ("support", "finance"):
        page = staff_page(role)
        page.set_viewport_size(LAPTOP)
        for name, url in pages.items():
            answer = page.goto(url)
            assert answer is not None and answer.status == 200, (role, name)
            assert page.locator("#result_list, #case-timeline").count() == 1, (role, name)
            assert overflowing(page) == [], (role, name)
        page.goto(pages["all refunds"])
        listing = page.locator("#result_list").inner_text()
        # Wrapped, not cut: the whole reference and both purchases are there to copy.
        assert PAYBACK_TX in listing
        assert {late.purchase_ref, duplicate.purchase_ref} <= set(listing.split())
