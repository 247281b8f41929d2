"""What a complaint names finds its purchase, and escalations have a person working them.

A buyer's operator writes in with a hash or a wallet from their explorer: the late transfer
that landed after the purchase failed, the duplicate one, finance's pay-back, or the wallet
a refund is owed to (a second authorization may come from another wallet than the
purchase's payer). Each finds the purchase in the admin search, through the real view; the
refund list shows the transfer refunded, and the attempt list does not call an attempt
whose money landed late only "failed". Support takes an escalation with "assign to me"."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from django.contrib import admin as django_admin
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from core.actors import Actor
from payments.models import Refund
from purchases.models import Escalation, Offering, Purchase
from purchases.services.remedy.remedies import escalation_open
from purchases.services.settle.late_payments import settlement_unexpected
from tests.admin.test_admin import _messages, _staff
from tests.factories import PAYER, PaymentAttemptFactory, PurchaseFactory, refund_paid_back

pytestmark = pytest.mark.django_db
LATE_TX = "0x" + "1a" * 32  # the late transfer: only its refund names it
PAYBACK_TX = "0x" + "2B" * 32  # finance's pay-back, typed as an explorer shows it
SECOND_WALLET = "0x" + "3c" * 20  # the second authorization's wallet, owed the duplicate
DUPLICATE_TX = "0x" + "4d" * 32


@dataclass
class Complaints:
    late: Purchase  # failed (refused), then its transfer landed: refund owed, then paid back
    duplicate: Purchase  # paid by one wallet, then a second wallet's transfer landed too
    other: Purchase  # an unrelated purchase: never found by these terms


def _unexpected(purchase: Purchase, attempt_pk: int, tx_hash: str) -> Refund:
    with transaction.atomic():
        locked = Purchase.objects.select_for_update().get(pk=purchase.pk)
        attempt = locked.payment_attempts.get(pk=attempt_pk)
        refund = settlement_unexpected(
            purchase=locked, attempt=attempt, tx_hash=tx_hash, now=timezone.now(),
            actor=Actor.system("test"),
        )  # fmt: skip
    assert refund is not None
    return refund


@pytest.fixture
def complaints(offering: Offering) -> Complaints:
    late = PurchaseFactory.create(quote__offering=offering, failed=True, payer=PAYER)
    refused = PaymentAttemptFactory.create(
        purchase=late, payer=PAYER, failed=True, tx_hash=None, reason_code="facilitator_rejected:x"
    )
    refund = _unexpected(late, refused.pk, LATE_TX)
    refund_paid_back(refund, PAYBACK_TX, by="fay")
    duplicate = PurchaseFactory.create(quote__offering=offering, paid=True, payer=PAYER)
    PaymentAttemptFactory.create(purchase=duplicate, payer=PAYER, succeeded=True)
    second = PaymentAttemptFactory.create(
        purchase=duplicate, payer=SECOND_WALLET, failed=True, tx_hash=None
    )
    _unexpected(duplicate, second.pk, DUPLICATE_TX)
    other = PurchaseFactory.create(quote__offering=offering, paid=True, payer="0x" + "5e" * 20)
    return Complaints(late, duplicate, other)


@pytest.fixture
def support() -> Client:
    return _staff("sam-support", "support")


@pytest.fixture
def finance() -> Client:
    return _staff("fay-finance", "finance")


def _found(client: Client, term: str) -> str:
    page = client.get(reverse("admin:purchases_purchase_changelist"), {"q": term})
    assert page.status_code == 200
    return page.content.decode()


@pytest.mark.parametrize("role", ["support", "finance"])
@pytest.mark.parametrize(
    ("term", "whose"),
    [
        (LATE_TX, "late"),
        (LATE_TX.upper().replace("0X", "0x"), "late"),
        (PAYBACK_TX, "late"),
        (PAYBACK_TX.lower(), "late"),
        (DUPLICATE_TX, "duplicate"),
        (SECOND_WALLET, "duplicate"),
        ("0x" + SECOND_WALLET[2:].upper(), "duplicate"),
    ],
    ids=["late tx", "late tx upper", "pay-back", "pay-back lower", "duplicate tx",
         "second wallet", "second wallet checksummed"],
)  # fmt: skip
def test_every_hash_and_wallet_a_complaint_names_finds_the_purchase(
    complaints: Complaints, support: Client, finance: Client, role: str, term: str, whose: str
) -> None:
    page = _found({"support": support, "finance": finance}[role], f" {term} ")
    wanted = getattr(complaints, whose)
    assert wanted.ref in page
    unwanted = {complaints.late.ref, complaints.duplicate.ref, complaints.other.ref} - {wanted.ref}
    assert not any(ref in page for ref in unwanted)


def test_the_refund_list_shows_the_transfer_refunded(
    complaints: Complaints, finance: Client
) -> None:
    page = finance.get(reverse("admin:payments_refund_changelist")).content.decode()
    assert "column-transaction" in page
    assert DUPLICATE_TX in page  # owed: on the list finance opens
    everything = finance.get(reverse("admin:payments_refund_changelist"), {"state": "all"})
    assert LATE_TX in everything.content.decode()


def test_an_attempt_whose_money_landed_late_is_not_only_failed(
    complaints: Complaints, support: Client
) -> None:
    page = support.get(reverse("admin:payments_paymentattempt_changelist")).content.decode()
    assert "late transfer: refund paid" in page
    assert "duplicate transfer: refund owed" in page


def _open_escalation(purchase: Purchase) -> Escalation:
    with transaction.atomic():
        return escalation_open(
            purchase=purchase, owner="support", reason_code="staff_escalated",
            now=timezone.now(), actor=Actor.system("test"),
        )  # fmt: skip


def test_assign_to_me_puts_the_person_on_the_escalation_and_the_timeline(
    complaints: Complaints, support: Client
) -> None:
    mine, theirs = _open_escalation(complaints.late), _open_escalation(complaints.duplicate)
    listing = reverse("admin:purchases_escalation_changelist")
    assert 'value="assign_to_me"' in support.get(listing).content.decode()
    done = support.post(
        listing, {"action": "assign_to_me", "_selected_action": [mine.pk], "index": 0}
    )
    assert done.status_code == 302
    assert _messages(done) == [  # type: ignore[arg-type]
        "Assigned 1 open escalation(s) to sam-support; 0 left (resolved, or already yours)."
    ]
    mine.refresh_from_db()
    theirs.refresh_from_db()
    assert (mine.assignee, mine.owner, theirs.assignee) == ("sam-support", "support", "")
    event = complaints.late.events.get(subject="escalation.assigned")
    assert (event.actor, event.evidence["assignee"]) == ("sam-support", "sam-support")
    # Shown in the list, and the list filters by it: mine, nobody's yet.
    assert "sam-support" in support.get(listing).content.decode()
    only_mine = support.get(listing, {"assignee": "__me__"}).content.decode()
    assert complaints.late.ref in only_mine and complaints.duplicate.ref not in only_mine
    nobodys = support.get(listing, {"assignee": "__none__"}).content.decode()
    assert complaints.duplicate.ref in nobodys and complaints.late.ref not in nobodys
    # Taking it again changes nothing and writes nothing.
    support.post(listing, {"action": "assign_to_me", "_selected_action": [mine.pk], "index": 0})
    assert complaints.late.events.filter(subject="escalation.assigned").count() == 1


def test_finance_cannot_assign_escalations(complaints: Complaints, finance: Client) -> None:
    escalation = _open_escalation(complaints.late)
    listing = reverse("admin:purchases_escalation_changelist")
    posted = finance.post(
        listing, {"action": "assign_to_me", "_selected_action": [escalation.pk], "index": 0}
    )
    assert posted.status_code == 403
    escalation.refresh_from_db()
    assert escalation.assignee == ""


def _refunds_found(client: Client, term: str) -> tuple[str, list[str]]:
    with CaptureQueriesContext(connection) as queries:
        page = client.get(reverse("admin:payments_refund_changelist"), {"q": term, "state": "all"})
    assert page.status_code == 200
    return page.content.decode(), [q["sql"] for q in queries.captured_queries]


@pytest.mark.parametrize(
    ("term", "whose"),
    [
        ("late_ref", "late"),
        (LATE_TX.upper().replace("0X", "0x"), "late"),
        (PAYBACK_TX.lower(), "late"),
        (SECOND_WALLET, "duplicate"),
        ("0x" + SECOND_WALLET[2:].upper(), "duplicate"),
        (DUPLICATE_TX, "duplicate"),
    ],
    ids=["purchase ref", "refunded tx upper", "pay-back lower", "wallet owed",
         "wallet owed checksummed", "duplicate tx"],
)  # fmt: skip
def test_the_refund_search_finds_each_refund_by_what_it_names_in_bounded_reads(
    complaints: Complaints, finance: Client, term: str, whose: str
) -> None:
    if term == "late_ref":
        term = complaints.late.ref
    page, statements = _refunds_found(finance, f" {term} ")
    wanted = getattr(complaints, whose)
    assert f">{wanted.ref}<" in page
    unwanted = {complaints.late.ref, complaints.duplicate.ref} - {wanted.ref}
    assert not any(f">{ref}<" in page for ref in unwanted)
    # At a million refunds (bench/scale.py): the admin goal's query count, one UNION of
    # look-ups instead of an OR across the join, no full count, no DISTINCT over refunds.
    assert len(statements) <= 10, statements
    assert any(" UNION " in sql for sql in statements)
    assert not any("DISTINCT" in sql and "payments_refund" in sql for sql in statements)
    assert not any(sql.startswith('SELECT COUNT(*) AS "__count" FROM') for sql in statements)


def test_the_refund_filters_offer_the_offerings_networks_and_recent_reasons(
    complaints: Complaints, finance: Client, offering: Offering
) -> None:
    listing = reverse("admin:payments_refund_changelist")
    page = finance.get(listing, {"state": "all"}).content.decode()
    assert f"?network={offering.network}".replace(":", "%3A") in page or (
        f"network={offering.network}" in page
    )
    reasons = set(Refund.objects.values_list("reason_code", flat=True))
    assert reasons and all(f"reason_code={reason}" in page for reason in reasons)
    for reason in reasons:
        chosen = finance.get(listing, {"state": "all", "reason_code": reason}).content.decode()
        refs = set(
            Refund.objects.filter(reason_code=reason).values_list("purchase__ref", flat=True)
        )
        others = {complaints.late.ref, complaints.duplicate.ref} - refs
        assert all(f">{ref}<" in chosen for ref in refs)
        assert not any(f">{ref}<" in chosen for ref in others)


def test_the_refund_lists_checkbox_is_djangos_markup(complaints: Complaints) -> None:
    # Written without a widget template per row (bench/scale.py), the same bytes.
    model_admin = django_admin.site._registry[Refund]
    for refund in Refund.objects.select_related("purchase"):
        ours = model_admin.action_checkbox(refund)
        assert ours == django_admin.ModelAdmin.action_checkbox(model_admin, refund)
        assert f'value="{refund.pk}"' in ours
