"""A paid x402 purchase whose settlement is not final yet, read and re-checked in Chromium.

On the local anvil chain (automine, finality depth 3, as `X402_LOCAL_FINALITY_DEPTH`
defaults) a paid call settles at 1 confirmation and its work runs at once: delivered, but a
reorg could still undo the transfer. Support opens the purchase: the Now box names the block,
how far from final it is, the finality watch as its owner and next check, and offers
"Re-check settlement now". Clicked before enough blocks, the look says so; after two more
blocks, the page says final.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.urls import reverse
from rest_framework.test import APIClient

from backoffice.roles import roles_ensure
from payments.models import PaymentAttempt
from purchases.models import Purchase
from purchases.services.fulfil.result_wait import listeners_close
from tests.browser.conftest import VIEWPORT, staff_context
from tests.x402.e2e import NETWORK, MakeWorld, ask, sign_payment

FINALITY_DEPTH = 3


def _box(page: Any) -> dict[str, str]:
    box = page.locator('[data-testid="case-now"]')
    finality = box.locator('[data-testid="case-finality"]')
    return {
        "sentence": box.locator('[data-testid="case-sentence"]').inner_text().strip(),
        "owner": box.locator('[data-testid="case-owner"]').inner_text().strip(),
        "state": finality.inner_text().strip(),
        "finality": finality.get_attribute("data-finality") or "",
        "next_check": box.locator('[data-testid="case-next-check"]').inner_text().strip(),
    }


def _recheck(page: Any) -> str:
    """Click "Re-check settlement now" as support does; the message the page then shows."""
    button = page.locator('[data-testid="case-now"] [data-testid="case-action-recheck_settlement"]')
    assert button.inner_text().strip() == "Re-check settlement now"
    with page.expect_navigation() as clicked:
        button.click()
    assert clicked.value is not None and clicked.value.status == 200
    return str(page.locator("ul.messagelist li").inner_text().strip())


@pytest.mark.django_db(transaction=True)
def test_a_paid_purchase_not_final_yet_is_rechecked_until_the_page_says_final(
    live_server_url: str, browser: Any, make_x402_world: MakeWorld, settings: Any
) -> None:
    world = make_x402_world()  # the session's automining anvil
    settings.X402_NETWORKS = {
        **settings.X402_NETWORKS,
        NETWORK: {**settings.X402_NETWORKS[NETWORK], "finality": "depth",
                  "finality_depth": FINALITY_DEPTH},
    }  # fmt: skip
    settings.X402_RESULT_WAIT_SECONDS = 30  # the paying request runs the report itself
    client = APIClient()
    payment = sign_payment(ask(client, world).headers["PAYMENT-REQUIRED"], world.payers[0], None)
    try:
        paid = ask(client, world, payment=payment)
    finally:
        listeners_close()  # the result wait's LISTEN connection would keep the database open
    assert paid.status_code == 200, paid.content  # paid and delivered
    purchase = Purchase.objects.get()
    attempt = PaymentAttempt.objects.get()
    assert attempt.final_at is None
    roles_ensure()
    User.objects.create_user(username="sue", is_staff=True).groups.add(
        Group.objects.get(name="support")
    )
    context = staff_context(browser, live_server_url, "sue", VIEWPORT)
    page = context.new_page()
    page.goto(reverse("admin:purchases_purchase_change", args=[purchase.pk]))

    box = _box(page)
    assert f"Payment settled in block {attempt.block_number}" in box["sentence"], box
    assert f"awaiting finality: depth at least 1 of {FINALITY_DEPTH}" in box["sentence"], box
    assert attempt.tx_hash in box["sentence"], box
    assert (box["owner"], box["finality"]) == ("reconciliation", "open"), box
    assert box["state"] == "can still change", box
    assert re.search(r"UTC \(in \d+ s\): finality watch", box["next_check"]), box

    # One block: the look finds it in the chain, depth 1 of 3: still not final.
    said = _recheck(page)
    assert said == "Settlement finality looked up: watching.", said
    box = _box(page)
    assert f"depth 1 of {FINALITY_DEPTH} reached" in box["sentence"], box
    assert box["finality"] == "open", box

    world.node.mine(FINALITY_DEPTH - 1)  # now 3 deep
    said = _recheck(page)
    assert said == "Settlement finality looked up: final.", said
    box = _box(page)
    assert (box["finality"], box["state"]) == ("final", "final"), box
    assert "awaiting finality" not in box["sentence"], box
    assert box["next_check"] == "none: final", box
    timeline = page.locator('[data-testid="case-timeline"]').inner_text()
    assert "Settlement re-checked by staff" in timeline, timeline
    attempt.refresh_from_db()
    assert attempt.final_at is not None
    context.close()
