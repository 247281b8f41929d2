"""Finance pays owed refunds out of the refund wallet in the browser: ticks them, approves
the batch, sees the payouts pending (what each awaits, its next check), and, once the chain
has mined them past finality and the reconcile job has run, sees the refunds paid."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.urls import reverse
from django.utils import timezone
from eth_account import Account

from devtools.situations import NETWORK
from payments.chain.token import balance_of
from payments.models import Payout, Refund
from purchases.models import Offering
from purchases.services.remedy.payout_reconcile import payouts_reconcile
from tests.browser.conftest import BrowserWorld, screenshot
from tests.factories import PaymentAttemptFactory, PurchaseFactory, RefundFactory
from tests.fixtures.anvil import erc20_transfer, new_account

FINALITY_DEPTH = 3  # X402_LOCAL_FINALITY_DEPTH's default
AMOUNTS = (250_000, 120_000)


def _owed_refunds(world: BrowserWorld, payers: list[Any]) -> list[Refund]:
    offering = Offering.objects.filter(asset=world.stage.token).order_by("pk").first()
    assert offering is not None
    refunds = []
    for payer, amount in zip(payers, AMOUNTS, strict=True):
        purchase = PurchaseFactory.create(quote__offering=offering, paid=True)
        attempt = PaymentAttemptFactory.create(
            purchase=purchase,
            payer=payer.address,
            network=NETWORK,
            asset=world.stage.token,
            amount=amount,
            succeeded=True,
        )
        refunds.append(RefundFactory.create(payment_attempt=attempt, amount=amount))
    return refunds


def test_finance_approves_a_batch_of_payouts_sees_them_pending_then_paid(
    browser_world: BrowserWorld, staff_page: Any, settings: Any
) -> None:
    node, token = browser_world.node, browser_world.stage.token
    w3 = node.w3()
    funded = [Account.from_key(key) for key in browser_world.stage.wallet_keys]
    payers = [new_account(node), new_account(node)]
    wallet = new_account(node)
    erc20_transfer(w3, token, funded[0], wallet.address, sum(AMOUNTS))
    settings.X402_NETWORKS[NETWORK]["refund_wallet_key"] = wallet.key.hex()
    settings.TOLLBOOTH = {**settings.TOLLBOOTH, "PAYOUT_DAILY_CAPS": {token.lower(): 10**9}}
    refunds = _owed_refunds(browser_world, payers)
    refunds_url = reverse("admin:payments_refund_changelist")

    finance = staff_page("finance")
    finance.goto(refunds_url)
    for refund in refunds:
        finance.check(f"input.action-select[value='{refund.pk}']")
    finance.select_option(
        "select[name=action]", label="Pay out from the refund wallet (approve batch)"
    )
    finance.click("button[name=index]")
    # The payer's wallet is the destination unless changed.
    for refund, payer in zip(refunds, payers, strict=True):
        assert finance.input_value(f"input[name=destination_{refund.pk}]") == payer.address
    screenshot(finance, "finance-approve-payouts")
    finance.click("input[name=apply]")
    said = finance.locator("ul.messagelist").inner_text()
    assert "Approved 2 payout(s): signed and recorded" in said

    listing = finance.locator("#result_list").inner_text()
    for payout in Payout.objects.all():
        assert f"payout {payout.pk} pending: signed and recorded, awaiting its broadcast" in listing
    assert "next check" in listing
    assert balance_of(w3, token, wallet.address) == sum(AMOUNTS)  # nothing sent yet

    # The beat's reconcile job, once the broadcast's grace has passed: sent, mined (automine),
    # one block deep of three.
    assert payouts_reconcile(now=timezone.now() + timedelta(minutes=2)) == {"broadcast_sent": 2}
    assert payouts_reconcile(now=timezone.now() + timedelta(minutes=3))["pending:finality"] == 2
    finance.goto(reverse("admin:payments_payout_changelist"))
    payouts_page = finance.locator("#result_list").inner_text()
    assert payouts_page.count("mined, awaiting finality (depth") == 2
    screenshot(finance, "finance-payouts-pending")

    node.mine(FINALITY_DEPTH)
    assert payouts_reconcile(now=timezone.now() + timedelta(minutes=4)) == {"confirmed": 2}
    finance.goto(refunds_url + "?state=paid")
    paid = finance.locator("#result_list").inner_text()
    for refund in refunds:
        payout = Payout.objects.get(refund=refund)
        assert payout.tx_hash in paid
        row = finance.locator("#result_list tr", has_text=refund.purchase.ref).inner_text()
        assert "\tPaid\t" in row and payout.tx_hash in row
    screenshot(finance, "finance-payouts-paid")
    for payer, amount in zip(payers, AMOUNTS, strict=True):
        assert balance_of(w3, token, payer.address) == amount
    assert balance_of(w3, token, wallet.address) == 0
