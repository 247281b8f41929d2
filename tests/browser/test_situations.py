"""Support opens each of the twelve situations in the admin, in a real browser.

The table below is what support must be able to read from the purchase page. The timeline
events are asserted on today's page (in order, other events may sit between them). The "Now"
box (owner, deadline, safe actions) is being built in parallel: its expectations are
written here and checked as soon as the page carries `data-testid="now-box"`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from devtools.situations import SITUATIONS
from tests.browser.conftest import BrowserWorld, screenshot

SUCCEEDED = [
    ("execution_attempt", "running", ""),
    ("execution_attempt", "succeeded", ""),
    ("purchase.fulfillment", "succeeded", ""),
]
PREPAID_PAID = [
    ("quote", "accepted", ""),
    ("payment_attempt", "succeeded", ""),
    ("purchase.payment", "paid", ""),
    ("purchase.fulfillment", "queued", ""),
]
X402_PENDING = [
    ("quote", "accepted", ""),
    ("payment_attempt", "recorded", ""),
    ("purchase.payment", "paying", ""),
    ("payment_attempt", "settlement_pending", "confirmation_timeout"),
    ("purchase.payment", "settlement_pending", "confirmation_timeout"),
]
X402_REFUSED = [
    ("quote", "accepted", ""),
    ("payment_attempt", "recorded", ""),
    ("payment_attempt", "failed", "facilitator_rejected:*"),
    ("purchase.payment", "failed", "facilitator_rejected:*"),
]


@dataclass(frozen=True)
class Expected:
    timeline: list[tuple[str, str, str]]  # (subject, to state, reason code; "x*" = prefix)
    owner: str | None  # whose move it is: buyer, reconciliation, support, finance; None: final
    has_deadline: bool
    actions: tuple[str, ...]  # what support is offered on the page
    page: str = "purchase"


EXPECTED: dict[str, Expected] = {
    "dropped-connection": Expected(PREPAID_PAID + SUCCEEDED, None, False, ()),
    "settlement-pending": Expected(
        [*X402_PENDING, ("payment_attempt", "succeeded", ""), ("purchase.payment", "paid", ""),
         *SUCCEEDED], None, False, ()),
    "dropped-broadcast": Expected(
        [*X402_PENDING, ("payment_attempt.resubmitted", "", "confirmation_timeout"),
         ("payment_attempt", "succeeded", ""), ("purchase.payment", "paid", ""), *SUCCEEDED],
        None, False, ()),
    "authorization-expired": Expected(
        [*X402_PENDING, ("payment_attempt", "failed", "authorization_expired_unused"),
         ("purchase.payment", "failed", "authorization_expired_unused")],
        "buyer", False, ()),
    "two-authorizations": Expected(
        [*X402_REFUSED, ("payment_attempt", "recorded", ""), ("purchase.payment", "paying", ""),
         ("purchase.payment", "paid", ""), *SUCCEEDED,
         ("purchase.payment", "paid", "duplicate_settlement"),
         ("refund", "owed", "duplicate_settlement")],
        "finance", False, ()),
    "late-transfer": Expected(
        [*X402_REFUSED, ("purchase.payment", "failed", "late_settlement"),
         ("refund", "owed", "late_settlement")],
        "finance", False, ()),
    "execution-failed": Expected(
        [*PREPAID_PAID, ("execution_attempt", "failed", "invalid_report_input"),
         ("purchase.fulfillment", "failed", "invalid_report_input"),
         ("refund", "owed", "execution_failed"), ("refund", "paid", "")],
        None, False, ()),
    "worker-killed": Expected(
        [*PREPAID_PAID, ("execution_attempt", "running", ""),
         ("execution_attempt", "running", "lease_expired_taken_over"),
         ("execution_attempt", "succeeded", ""), ("purchase.fulfillment", "succeeded", "")],
        None, False, ()),
    "job-service-down": Expected(
        [*PREPAID_PAID, ("execution_attempt", "running", "executor_retry"), *SUCCEEDED[1:]],
        None, False, ()),
    "payment-id-conflict": Expected(PREPAID_PAID + SUCCEEDED, None, False, ()),
    "balance-too-small": Expected([], "buyer", False, (), page="buyer"),
    "result-expired": Expected(PREPAID_PAID + SUCCEEDED, None, False, ()),
}  # fmt: skip


def test_the_table_covers_every_situation() -> None:
    assert set(EXPECTED) == set(SITUATIONS)


def timeline(page: Any) -> list[tuple[str, str, str]]:
    """The timeline inline's rows as (subject, to state, reason code), as support reads them."""
    rows = page.locator("#events-group tbody tr.form-row")
    found = []
    for index in range(rows.count()):
        row = rows.nth(index)
        cells = [row.locator(f"td.field-{name}").inner_text().strip()
                 for name in ("subject", "to_state", "reason_code")]  # fmt: skip
        found.append(tuple("" if cell == "-" else cell for cell in cells))
    return found  # type: ignore[return-value]


def _matches(event: tuple[str, str, str], wanted: tuple[str, str, str]) -> bool:
    return all(
        got.startswith(want[:-1]) if want.endswith("*") else got == want
        for got, want in zip(event, wanted, strict=True)
    )


def assert_in_order(events: list[tuple[str, str, str]], wanted: list[tuple[str, str, str]]) -> None:
    remaining = iter(events)
    for item in wanted:
        assert any(_matches(event, item) for event in remaining), (
            f"{item} missing (in order) from the timeline:\n" + "\n".join(map(str, events))
        )


def assert_now_box(page: Any, expected: Expected) -> None:
    """The Now box, once the page has one (the lead tightens this after the merge)."""
    box = page.locator('[data-testid="now-box"]')
    if box.count() == 0:
        return
    owner = box.locator('[data-testid="now-owner"]')
    if expected.owner is not None:
        assert expected.owner in owner.inner_text().lower()
    deadline = box.locator('[data-testid="now-deadline"]')
    assert (deadline.count() > 0) == expected.has_deadline
    offered = box.locator('[data-testid^="now-action-"]')
    names = {offered.nth(i).get_attribute("data-testid") for i in range(offered.count())}
    assert names == {f"now-action-{action}" for action in expected.actions}


@pytest.mark.parametrize("name", list(SITUATIONS))
def test_support_reads_the_situation_from_the_admin(
    name: str, browser_world: BrowserWorld, staff_page: Any
) -> None:
    played = SITUATIONS[name](browser_world.stage)
    expected = EXPECTED[name]
    page = staff_page("support")
    answer = page.goto(played.admin_url)
    assert answer is not None and answer.status == 200
    if expected.page == "purchase":
        assert played.purchase_ref is not None
        assert played.purchase_ref in page.title()
        assert_in_order(timeline(page), expected.timeline)
    else:
        assert "View buyer" in page.title()  # no purchase is kept for a refused prepaid try
    assert_now_box(page, expected)
    screenshot(page, name)
