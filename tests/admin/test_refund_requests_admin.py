"""The refund-request queue in the admin (issue 33, part 2): support sees the case's facts
beside each request and decides it; approval feeds the existing proposal / finance approval
/ payout path; a denial's reason code is what the buyer reads."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.messages import get_messages
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from payments.models import Refund
from purchases.models import Buyer, PurchaseEvent, RefundRequest
from purchases.services.remedy.case_actions import case_refund_decide
from tests.purchases.test_refund_requests import WALLET, ask, settled_purchase

pytestmark = pytest.mark.django_db


def _messages(response: Any) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]  # type: ignore[attr-defined]


@pytest.fixture
def asked(buyer: Buyer, client_for_buyer: APIClient) -> RefundRequest:
    purchase = settled_purchase(buyer=buyer)
    assert ask(client_for_buyer, purchase, 400_000).status_code == 201
    return RefundRequest.objects.get(purchase=purchase)


def _decide_url(request: RefundRequest) -> str:
    return reverse("admin:purchases_refundrequest_decide", args=[request.pk])


def _change_url(request: RefundRequest) -> str:
    return reverse("admin:purchases_refundrequest_change", args=[request.pk])


def test_the_queue_puts_open_requests_first_by_deadline_with_their_owner(
    support: Client, asked: RefundRequest, buyer: Buyer, client_for_buyer: APIClient
):
    later = settled_purchase(buyer=buyer)
    assert ask(client_for_buyer, later, 1).status_code == 201
    RefundRequest.objects.filter(purchase=later).update(
        deadline_at=timezone.now() - timedelta(hours=1)
    )
    page = support.get(reverse("admin:purchases_refundrequest_changelist"))
    assert page.status_code == 200
    text = page.content.decode()
    overdue = RefundRequest.objects.get(purchase=later)
    assert text.index(overdue.public_id) < text.index(asked.public_id)
    support.post(
        reverse("admin:purchases_refundrequest_changelist"),
        {"action": "assign_to_me", "_selected_action": [asked.pk]},
    )
    asked.refresh_from_db()
    assert asked.assignee == "sam-support"


def test_the_request_page_shows_the_case_facts_and_a_decide_button_to_support(
    support: Client, finance: Client, asked: RefundRequest
):
    page = support.get(_change_url(asked)).content.decode()
    assert "Left to refund" in page
    assert WALLET.address in page  # paid by
    assert "the report was empty" in page
    assert _decide_url(asked) in page
    # Finance reads the queue but decides the proposal, not the request.
    finance_page = finance.get(_change_url(asked)).content.decode()
    assert "Left to refund" in finance_page
    assert _decide_url(asked) not in finance_page
    assert finance.post(_decide_url(asked), {"decision": "approve"}).status_code == 403
    asked.refresh_from_db()
    assert asked.state == RefundRequest.State.OPEN


def test_approving_in_the_admin_proposes_the_refund_finance_approves_for_the_payer(
    support: Client, asked: RefundRequest, client_for_buyer: APIClient
):
    response = support.post(_decide_url(asked), {"decision": "approve", "note": "empty"})
    assert response.status_code == 302
    assert any("Approved" in m for m in _messages(response))
    asked.refresh_from_db()
    refund = Refund.objects.get()
    assert (asked.state, asked.refund_id, asked.decided_by) == (
        "approved",
        refund.pk,
        "sam-support",
    )
    assert (refund.state, refund.amount, refund.payer, refund.method) == (
        Refund.State.PROPOSED,
        400_000,
        WALLET.address,
        Refund.Method.PAY_BACK,
    )
    # Finance's existing decision on the proposal: owed, to the paying wallet.
    case_refund_decide(refund_id=refund.pk, approve=True, staff="fay-finance")
    refund.refresh_from_db()
    assert refund.state == Refund.State.OWED
    polled = client_for_buyer.get(f"/api/v1/purchases/{asked.purchase.ref}/refund-requests/"
                                  f"{asked.public_id}").json()  # fmt: skip
    assert (polled["status"], polled["refund"]["state"]) == ("pending", "owed")
    # A second decision changes nothing and says so.
    again = support.post(_decide_url(asked), {"decision": "deny", "denial_code": "not_eligible"})
    assert any("Nothing changed" in m for m in _messages(again))
    assert Refund.objects.count() == 1


def test_denying_in_the_admin_needs_a_reason_code_the_buyer_then_reads(
    support: Client, asked: RefundRequest, client_for_buyer: APIClient
):
    missing = support.post(_decide_url(asked), {"decision": "deny"})
    assert missing.status_code == 200  # the form again, with its error
    assert "Choose the reason code" in missing.content.decode()
    asked.refresh_from_db()
    assert asked.state == RefundRequest.State.OPEN

    support.post(
        _decide_url(asked),
        {"decision": "deny", "denial_code": "insufficient_evidence", "note": "no details"},
    )
    polled = client_for_buyer.get(
        f"/api/v1/purchases/{asked.purchase.ref}/refund-requests/{asked.public_id}"
    ).json()
    assert (polled["status"], polled["reason_code"]) == ("denied", "insufficient_evidence")
    denied = PurchaseEvent.objects.get(subject="refund_request", to_state="denied")
    assert (denied.actor, denied.reason_code) == ("sam-support", "insufficient_evidence")
    assert not Refund.objects.exists()


def test_the_approved_refund_pays_out_to_the_paying_wallet_by_default(
    support: Client, finance: Client, asked: RefundRequest
):
    """The payout form finance opens for the owed refund offers the payer's wallet; another
    destination waits for a second approver (payments' existing rule)."""
    support.post(_decide_url(asked), {"decision": "approve"})
    refund = Refund.objects.get()
    case_refund_decide(refund_id=refund.pk, approve=True, staff="fay-finance")
    form = finance.post(
        reverse("admin:payments_refund_changelist"),
        {"action": "approve_payouts", "_selected_action": [refund.pk]},
    )
    assert form.status_code == 200
    page = form.content.decode()
    assert f'name="destination_{refund.pk}"' in page
    assert f'value="{WALLET.address}"' in page
    assert "Another one needs a second approver" in page
