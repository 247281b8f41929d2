"""Every action the case file offers, clicked in Chromium as a person does: the button in
the Now box, the action's own form when it asks for input (filled and applied), then what
the page says. A button whose form is nested in the admin's change form posts that outer
form instead (a bare 403 on the view-only page): this is what catches it.

The cases are tests/admin/test_case_file_admin.py's (built through the API and the ORM, no
chain nor worker): a settlement pending on a chain that does not answer, work stalled in the
queue, work with an unknown outcome under an open escalation, a finished purchase with its
result kept; finance then decides what support proposed.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.urls import reverse

from backoffice.roles import roles_ensure
from purchases.models import Purchase
from tests.admin.test_case_file_admin import Cases, cases  # noqa: F401  (the fixture)
from tests.browser.conftest import VIEWPORT, staff_context
from tests.factories import USDC_LOCAL, PaymentAttemptFactory

# What the page says after each action, as the person reads it (the admin's message).
SAYS = {
    "recheck_settlement": r"^Settlement looked up: pending\.$",
    "reconcile_execution": r"^(Execution staged again; a worker resumes it from the saved "
    r"job\.|Job inspected: never_started\.)$",
    "redeliver_result": r"^Send the buyer this link: https?://[^/ ]+/x402/purchases/pur_\w+/\w+",
    "assign": r"^Assigned to support until 2099-01-01 12:00:00 UTC\.$",
    "propose_refund": r"^Proposed refund of 250000; finance approves it\.$",
    "resolve": r"^Escalation resolved\.$",
    "approve_refund": r"^Refund \d+ is now paid\.$",  # prepaid: credited at once
}
# Timeline labels the action leaves, read on the purchase page after it.
LEAVES = {
    "recheck_settlement": "Settlement re-checked by staff",
    "reconcile_execution": "Execution reconciled by staff",
    "redeliver_result": "Result redelivery prepared by staff",
}


def _fill(page: Any, action: str) -> None:
    """The action's own form, filled as support or finance would."""
    if action == "assign":
        page.select_option("select[name=owner]", "support")
        page.fill("input[name=deadline_at]", "2099-01-01 12:00:00")
        page.fill("textarea[name=note]", "Called the buyer; checking the job service.")
    elif action == "propose_refund":
        page.select_option("select[name=kind]", "refund")
        page.fill("textarea[name=note]", "Goodwill: the report came late.")
    elif action == "resolve":
        page.select_option("select[name=code]", "buyer_informed")
        page.fill("textarea[name=note]", "Told the buyer what happened.")
    elif action == "approve_refund":
        page.select_option("select[name=decision]", "approve")


def _perform(page: Any, purchase: Purchase, action: str) -> str:
    """Click `action` in the Now box of the purchase's page; fill and apply its form when it
    has one; return the message the purchase page then shows."""
    change = reverse("admin:purchases_purchase_change", args=[purchase.pk])
    page.goto(change)
    with page.expect_navigation() as clicked:
        page.click(f'[data-testid="case-now"] [data-testid="case-action-{action}"]')
    answer = clicked.value
    assert answer is not None and answer.status == 200, (action, answer and answer.status)
    if page.locator('[data-testid="case-action-apply"]').count():
        _fill(page, action)
        with page.expect_navigation() as applied:
            page.click('[data-testid="case-action-apply"]')
        assert applied.value.status == 200, action
    assert page.url.endswith(change), (action, page.url)  # back on the purchase's page
    return page.locator("ul.messagelist li").inner_text().strip()


def _offered(page: Any) -> set[str]:
    buttons = page.locator('[data-testid="case-now"] [data-testid^="case-action-"]')
    return {
        (buttons.nth(i).get_attribute("data-testid") or "").removeprefix("case-action-")
        for i in range(buttons.count())
    }


def _staff(username: str, group: str) -> str:
    user = User.objects.create_user(username=username, is_staff=True)
    user.groups.add(Group.objects.get(name=group))
    return username


@pytest.mark.django_db(transaction=True)
def test_every_offered_case_action_works_when_clicked(
    live_server_url: str,
    browser: Any,
    cases: Cases,  # noqa: F811
    settings: Any,
) -> None:
    # A chain that does not answer (nothing listens on port 9): the look-up says so.
    settings.X402_NETWORKS = {
        **settings.X402_NETWORKS,
        "eip155:31337": {
            **settings.X402_NETWORKS["eip155:31337"],
            "rpc_url": "http://127.0.0.1:9",
            "token_address": USDC_LOCAL,
        },
    }
    # A paid purchase has its settled payment (the shared fixture builds the state alone).
    for paid in (cases.stalled, cases.unknown):
        PaymentAttemptFactory.create(purchase=paid, succeeded=True)
    roles_ensure()
    support = staff_context(browser, live_server_url, _staff("sue", "support"), VIEWPORT)
    finance = staff_context(browser, live_server_url, _staff("fin", "finance"), VIEWPORT)
    page = support.new_page()
    clicked: set[str] = set()
    for purchase in (cases.pending, cases.stalled, cases.unknown, cases.done):
        page.goto(reverse("admin:purchases_purchase_change", args=[purchase.pk]))
        for action in sorted(_offered(page)):
            said = _perform(page, purchase, action)
            assert re.search(SAYS[action], said), (purchase.ref, action, said)
            if action in LEAVES:
                timeline = page.locator('[data-testid="case-timeline"]').inner_text()
                assert LEAVES[action] in timeline, (action, timeline)
            clicked.add(action)
    # Support proposed a refund on the finished purchase: finance decides it, by clicking.
    finance_page = finance.new_page()
    finance_page.goto(reverse("admin:purchases_purchase_change", args=[cases.done.pk]))
    assert _offered(finance_page) == {"approve_refund"}
    said = _perform(finance_page, cases.done, "approve_refund")
    assert re.search(SAYS["approve_refund"], said), said
    clicked.add("approve_refund")
    assert clicked == set(SAYS)  # every action the case file has was clicked at least once
    support.close()
    finance.close()
