"""The back office, driven through the admin with real staff users in the real roles."""

from __future__ import annotations

import hashlib
import html
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth.models import Group, User
from django.contrib.messages import get_messages
from django.db import transaction
from django.db.models import F
from django.forms.models import model_to_dict
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from backoffice.roles import roles_ensure
from core.actors import Actor
from fulfillment.models import ExecutionAttempt, Receipt, Result
from payments.models import ExportBatch, LedgerEntry, PaymentAttempt, Payout, Refund
from payments.services import export_batch_record
from purchases.models import (
    ApiKey,
    Buyer,
    Escalation,
    IdempotencyRecord,
    JobRun,
    Offering,
    Purchase,
    PurchaseEvent,
)
from purchases.services.fulfil.execution import ExecutionOutcome, purchase_execute
from purchases.services.remedy.remedies import (
    escalation_open,
    escalation_resolve,
    purchase_refund_create,
)
from tests.conftest import CSV_INPUT
from tests.factories import (
    USDC_LOCAL,
    OfferingFactory,
    PaymentAttemptFactory,
    PayoutFactory,
    PurchaseFactory,
)
from tests.fixtures.anvil import closed_port_url
from tests.purchases.test_refund_requests import ask, settled_purchase

pytestmark = pytest.mark.django_db

WALLET = "0x" + "b7" * 20
TX_HASH = "0x" + "3c" * 32
CSV_HEADER = (
    "purchase,method,payer,amount_atomic,amount,asset_symbol,asset,network,transaction,reason,"
    "state,created_at,paid_reference,ledger_reference,paid_at\r\n"
)


@dataclass
class World:
    prepaid: Purchase
    x402: Purchase
    owed: Refund
    paid: Refund
    escalation: Escalation


def _paid_prepaid_purchase(client: APIClient, offering: Offering) -> Purchase:
    """The real way: quote and pay through the agent API, then run the work."""
    quote = client.post(
        "/api/v1/quotes", {"offering": offering.slug, "input": CSV_INPUT}, format="json"
    )
    assert quote.status_code == 201, quote.content
    paid = client.post(
        f"/api/v1/quotes/{quote.json()['id']}/purchase",
        {"rail": "prepaid"},
        format="json",
        HTTP_IDEMPOTENCY_KEY="pay-admin-0001-aaaa",
    )
    assert paid.status_code == 201, paid.content
    purchase = Purchase.objects.get(ref=paid.json()["purchase"])
    assert purchase_execute(purchase_id=purchase.pk, worker="test") == ExecutionOutcome.SUCCEEDED
    return purchase


def _late_x402_purchase(offering: Offering) -> tuple[Purchase, PaymentAttempt]:
    """An x402 purchase marked failed whose transfer landed anyway (built via the ORM)."""
    purchase = PurchaseFactory.create(
        quote__offering=offering, quote__canonical_input=CSV_INPUT, payer=WALLET, failed=True
    )
    attempt = PaymentAttemptFactory.create(
        purchase=purchase,
        payment_id="pay-x402-0001-bbbb",
        payer=WALLET,
        tx_hash=TX_HASH,
        succeeded=True,
    )
    return purchase, attempt


@pytest.fixture
def world(client_for_buyer: APIClient, buyer: Buyer, offering: Offering) -> World:
    prepaid = _paid_prepaid_purchase(client_for_buyer, offering)
    x402, attempt = _late_x402_purchase(offering)
    now = timezone.now()
    system = Actor.system("test")
    with transaction.atomic():
        owed = purchase_refund_create(
            purchase=x402, attempt=attempt, reason_code="late_confirmation", now=now, actor=system
        )
    with transaction.atomic():
        # A prepaid refund is credited to the balance, so it is paid at once.
        paid = purchase_refund_create(
            purchase=prepaid,
            attempt=prepaid.payment_attempts.get(),
            reason_code="goodwill",
            now=now,
            actor=system,
        )
    with transaction.atomic():
        escalation = escalation_open(
            purchase=prepaid,
            owner=Escalation.OwnerRole.SUPPORT,
            reason_code="execution_outcome_unknown",
            now=now,
            actor=system,
        )
    JobRun.objects.create(
        job="pending_settlements", started_at=now, finished_at=now, stats={"claimed": 0}
    )
    # The buyer asks for money back on a settled purchase: the refund-request queue's row.
    assert ask(client_for_buyer, settled_purchase(buyer=buyer), 1).status_code == 201
    # Every page renders a payout; a cancelled one, so `owed` stays free for a hand payback
    # (a live payout would refuse it: payback_payout_live) and no refund is added.
    PayoutFactory.create(refund=owed, awaiting_approval=True, state=Payout.State.CANCELLED)
    return World(prepaid, x402, owed, paid, escalation)


def _staff(username: str, group: str | None = None, *, superuser: bool = False) -> Client:
    roles_ensure()
    user = User.objects.create_user(username=username, is_staff=True, is_superuser=superuser)
    if group:
        user.groups.add(Group.objects.get(name=group))
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def support() -> Client:
    return _staff("sam-support", "support")


@pytest.fixture
def finance() -> Client:
    return _staff("fay-finance", "finance")


@pytest.fixture
def superuser() -> Client:
    return _staff("root", superuser=True)


def _messages(response: Any) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]  # type: ignore[attr-defined]


def _changelist(model: type[Any]) -> str:
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")


def _change(obj: Any) -> str:
    opts = obj._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk])


def _action(client: Client, model: type[Any], action: str, pks: list[int], **data: Any) -> Any:
    # Without "index" this is the intermediate page posting back, as Django's own do.
    return client.post(_changelist(model), {"action": action, "_selected_action": pks, **data})


# --- every screen renders, with data -------------------------------------------------
OUR_MODELS = [
    m for m in admin.site._registry if m._meta.app_label in ("purchases", "payments", "fulfillment")
]


def test_every_admin_renders_its_list_and_detail(world: World, superuser: Client) -> None:
    assert {m.__name__ for m in OUR_MODELS} == {
        "Offering",
        "Buyer",
        "Quote",
        "Purchase",
        "Escalation",
        "IdempotencyRecord",
        "PaymentAttempt",
        "LedgerEntry",
        "Refund",
        "ExecutionAttempt",
        "Result",
        "Receipt",
        "JobRun",
        "LedgerBalance",
        "ExportBatch",
        "Payout",
        "RefundRequest",
    }
    export_batch_record(
        kind="refunds",
        created_by="root",
        filters={},
        row_count=0,
        sha256=hashlib.sha256(b"").hexdigest(),
        started_at=timezone.now(),
        first_created_at=None,
        last_created_at=None,
    )
    for model in OUR_MODELS:
        # Refunds open on the owed list; "all" shows the paid one too.
        listing = superuser.get(_changelist(model), {"state": "all"} if model is Refund else {})
        assert listing.status_code == 200, model
        obj = model._default_manager.order_by("pk").first()
        assert obj is not None, f"no {model.__name__} in the test data"
        assert listing.context["cl"].result_count >= 1, model
        detail = superuser.get(_change(obj))
        assert detail.status_code == 200, model
    for add_url in ("admin:purchases_offering_add", "admin:purchases_buyer_add"):
        assert superuser.get(reverse(add_url)).status_code == 200


def test_support_can_open_every_screen(world: World, support: Client) -> None:
    for model in OUR_MODELS:
        if model is ExportBatch:
            assert support.get(_changelist(model)).status_code == 403  # finance's books
            continue
        assert support.get(_changelist(model)).status_code == 200, model
        obj = model._default_manager.order_by("pk").first()
        assert support.get(_change(obj)).status_code == 200, model


def test_site_header(superuser: Client) -> None:
    assert "Tollbooth back office" in superuser.get(reverse("admin:index")).content.decode()


def test_purchase_page_shows_timeline_evidence_and_result_metadata_never_the_body(
    world: World, support: Client
) -> None:
    purchase = world.prepaid
    result = Result.objects.get(purchase=purchase)
    page = support.get(_change(purchase)).content.decode()
    for subject in ("purchase.payment", "purchase.fulfillment", "escalation", "refund"):
        assert subject in page
    assert result.sha256 in page
    assert str(result.size) in page
    assert Receipt.objects.get(purchase=purchase).public_id in page
    assert ExecutionAttempt.objects.get(purchase=purchase).worker in page
    assert "execution_outcome_unknown" in page
    assert "0.250000 USDC" in page
    body = bytes(result.body).decode()
    assert body not in html.unescape(page)
    assert body not in html.unescape(support.get(_change(result)).content.decode())
    events = list(purchase.events.order_by("created_at", "pk"))
    positions = [page.index(f'id="case-event-{e.pk}"') for e in events]
    assert positions == sorted(positions)  # rendered in timeline order
    assert "Payment recorded as paid" in page  # a human label, the subject only as a hint


def test_purchase_search_by_tx_hash(world: World, support: Client) -> None:
    # Explorers show checksummed or upper-case hashes; the search must still match.
    found = support.get(_changelist(Purchase), {"q": TX_HASH.upper()}).content.decode()
    assert world.x402.ref in found
    assert world.prepaid.ref not in found
    by_payer = support.get(_changelist(Purchase), {"q": WALLET}).content.decode()
    assert world.x402.ref in by_payer and world.prepaid.ref not in by_payer


# --- state fields are not editable ------------------------------------------------------
def test_state_fields_cannot_be_edited_through_the_admin(world: World, superuser: Client) -> None:
    purchase, escalation, refund = world.x402, world.escalation, world.owed
    edits = [
        (purchase, {"payment_state": "paid", "fulfillment_state": "succeeded"}),
        (escalation, {"state": "resolved", "resolution": "edited"}),
        (refund, {"state": "paid", "paid_reference": "edited"}),
    ]
    for obj, data in edits:
        assert superuser.post(_change(obj), data).status_code == 403
    purchase.refresh_from_db()
    escalation.refresh_from_db()
    refund.refresh_from_db()
    assert (purchase.payment_state, purchase.fulfillment_state) == ("failed", "not_started")
    assert (escalation.state, escalation.resolution) == ("open", "")
    assert (refund.state, refund.paid_reference) == ("owed", "")
    page = superuser.get(_change(purchase)).content.decode()
    assert 'name="payment_state"' not in page


# --- escalations ------------------------------------------------------------------------
def test_resolve_action_asks_for_a_text_then_resolves_with_an_event(
    world: World, support: Client
) -> None:
    escalation = world.escalation
    ask = support.post(
        _changelist(Escalation),
        {"action": "resolve_selected", "_selected_action": [escalation.pk], "index": 0},
    )
    assert ask.status_code == 200
    assert 'name="resolution"' in ask.content.decode()
    escalation.refresh_from_db()
    assert escalation.state == "open"

    done = _action(
        support,
        Escalation,
        "resolve_selected",
        [escalation.pk],
        apply="Resolve",
        code="result_delivered",
        resolution="Job finished upstream; result redelivered.",
    )
    assert done.status_code == 302
    assert _messages(done) == ["Resolved 1 escalation(s)."]
    escalation.refresh_from_db()
    assert escalation.state == "resolved"
    assert escalation.resolution == "Job finished upstream; result redelivered."
    assert escalation.resolved_by == "sam-support"
    assert escalation.resolution_code == "result_delivered"
    event = PurchaseEvent.objects.filter(subject="escalation").order_by("pk").last()
    assert event is not None
    assert (event.from_state, event.to_state) == ("open", "resolved")
    assert (event.actor_type, event.actor) == ("staff", "sam-support")
    assert event.evidence == {
        "escalation": escalation.pk,
        "resolution_code": "result_delivered",
        "resolution": "Job finished upstream; result redelivered.",
    }


def test_empty_resolution_changes_nothing(world: World, support: Client) -> None:
    events = PurchaseEvent.objects.count()
    response = _action(
        support,
        Escalation,
        "resolve_selected",
        [world.escalation.pk],
        apply="Resolve",
        code="other",
        resolution="   ",
    )
    assert response.status_code == 200
    assert "Say how it was resolved; nothing was changed." in response.content.decode()
    world.escalation.refresh_from_db()
    assert (world.escalation.state, world.escalation.resolution) == ("open", "")
    assert PurchaseEvent.objects.count() == events


def test_resolve_button_on_the_escalation_page(world: World, support: Client) -> None:
    escalation = world.escalation
    resolve_url = reverse("admin:purchases_escalation_resolve", args=[escalation.pk])
    assert resolve_url in support.get(_change(escalation)).content.decode()
    assert 'name="resolution"' in support.get(resolve_url).content.decode()
    done = support.post(
        resolve_url, {"apply": "Resolve", "code": "other", "resolution": "Refunded by hand."}
    )
    assert done.status_code == 302 and done["Location"] == _change(escalation)
    escalation.refresh_from_db()
    assert (escalation.state, escalation.resolution) == ("resolved", "Refunded by hand.")
    assert resolve_url not in support.get(_change(escalation)).content.decode()


def test_open_escalations_come_first_with_overdue_flag(world: World, support: Client) -> None:
    an_hour_ago = timezone.now() - timedelta(hours=1)
    overdue = Escalation.objects.create(
        purchase=world.x402,
        owner=Escalation.OwnerRole.FINANCE,
        reason_code="late_confirmation",
        deadline_at=an_hour_ago,
    )
    closed = Escalation.objects.create(
        purchase=world.x402,
        owner=Escalation.OwnerRole.SUPPORT,
        reason_code="payment_unclear",
        deadline_at=an_hour_ago - timedelta(hours=1),
    )
    with transaction.atomic():
        escalation_resolve(escalation=closed, by="someone", resolution="done", now=timezone.now())
    page = support.get(_changelist(Escalation)).content.decode()
    rows = [page.index(f"/{e.pk}/change/") for e in (overdue, world.escalation, closed)]
    assert rows == sorted(rows)  # open by deadline, then the resolved one
    assert page.count('alt="True"') == 1  # only the open, past-deadline one is overdue


def test_finance_cannot_resolve_escalations(world: World, finance: Client) -> None:
    escalation = world.escalation
    resolve_url = reverse("admin:purchases_escalation_resolve", args=[escalation.pk])
    by_action = _action(
        finance, Escalation, "resolve_selected", [escalation.pk], apply="1", resolution="x"
    )
    assert by_action.status_code == 403
    assert finance.post(resolve_url, {"apply": "1", "resolution": "x"}).status_code == 403
    escalation.refresh_from_db()
    assert (escalation.state, escalation.resolution) == ("open", "")


# --- refunds ----------------------------------------------------------------------------
def test_refund_list_defaults_to_owed_with_human_amounts(world: World, finance: Client) -> None:
    page = finance.get(_changelist(Refund)).content.decode()
    assert world.x402.ref in page
    assert "0.250000 USDC" in page
    assert world.prepaid.ref not in page  # its refund is already paid
    every = finance.get(_changelist(Refund), {"state": "all"}).content.decode()
    assert world.prepaid.ref in every


def test_mark_paid_needs_a_reference_and_an_unanswered_chain_leaves_it_pending(
    world: World, finance: Client, settings: Any
) -> None:
    refund = world.owed
    field = f"reference_{refund.pk}"
    ask = _action(finance, Refund, "mark_paid_back", [refund.pk])
    assert ask.status_code == 200 and f'name="{field}"' in ask.content.decode()

    empty = _action(finance, Refund, "mark_paid_back", [refund.pk], apply="1", **{field: " "})
    assert empty.status_code == 200
    assert "Not every refund could be closed" in empty.content.decode()
    refund.refresh_from_db()
    assert (refund.state, refund.paid_reference) == ("owed", "")

    # The node cannot be asked: the payback is pending (checked again), never paid nor failed.
    network = dict(
        settings.X402_NETWORKS["eip155:31337"], rpc_url=closed_port_url(), token_address=USDC_LOCAL
    )
    settings.X402_NETWORKS = {**settings.X402_NETWORKS, "eip155:31337": network}
    payback = "0x" + "9d" * 32
    done = _action(finance, Refund, "mark_paid_back", [refund.pk], apply="1", **{field: payback})
    assert done.status_code == 302
    (said,) = _messages(done)
    assert said.startswith(f"Refund {refund.pk} ({refund.purchase.ref}) stays owed, its payback ")
    assert "payback_chain_unavailable: Pending: the node could not be asked." in said
    refund.refresh_from_db()
    assert (refund.state, refund.paid_reference, refund.payback_tx_hash) == ("owed", "", payback)
    assert refund.payback_next_check_at is not None
    assert f"checked again at {refund.payback_next_check_at:%Y-%m-%d %H:%M:%S} UTC" in said
    event = refund.purchase.events.filter(subject="refund").order_by("pk").last()
    assert event is not None
    assert (event.from_state, event.to_state, event.actor_type, event.actor) == (
        "owed",
        "owed",
        "staff",
        "fay-finance",
    )
    assert (event.reason_code, event.evidence["tx_hash"]) == ("payback_chain_unavailable", payback)


def test_support_cannot_mark_refunds_paid(world: World, support: Client) -> None:
    refund = world.owed
    field = f"reference_{refund.pk}"
    response = _action(
        support, Refund, "mark_paid_back", [refund.pk], apply="1", index=0, **{field: "0xdead"}
    )
    assert response.status_code == 403  # a forged action, not "No action selected"
    refund.refresh_from_db()
    assert (refund.state, refund.paid_reference) == ("owed", "")
    assert 'value="mark_paid_back"' not in support.get(_changelist(Refund)).content.decode()


def test_export_csv_is_exact(world: World, finance: Client) -> None:
    owed, paid = Refund.objects.get(pk=world.owed.pk), Refund.objects.get(pk=world.paid.pk)
    assert paid.paid_at is not None
    buyer = world.prepaid.buyer
    assert buyer is not None
    response = finance.post(
        _changelist(Refund) + "?state=all",
        {"action": "export_csv", "_selected_action": [owed.pk, paid.pk], "index": 0},
    )
    assert response.status_code == 200
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert response["Content-Disposition"] == 'attachment; filename="refunds.csv"'
    body = b"".join(response.streaming_content).decode()  # type: ignore[attr-defined]
    assert body == (
        CSV_HEADER
        + f"{world.x402.ref},pay_back,{WALLET},250000,0.250000,USDC,{USDC_LOCAL},eip155:31337,"
        f"{TX_HASH},late_confirmation,owed,{owed.created_at.isoformat()},,,\r\n"
        + f"{world.prepaid.ref},ledger_credit,{buyer.ref},250000,0.250000,USDC,{USDC_LOCAL},"
        f"prepaid,,goodwill,paid,{paid.created_at.isoformat()},refund:{paid.pk},"
        f"refund:{paid.pk},{paid.paid_at.isoformat()}\r\n"
    )


# --- buyers, keys and the ledger ---------------------------------------------------------
def test_issue_api_key_shows_it_once_and_keeps_only_the_hash(superuser: Client) -> None:
    from purchases.services.shared.buyers import buyer_create

    buyer = buyer_create(name="agent-admin", wallets=[WALLET.upper().replace("0X", "0x")])
    response = superuser.post(
        _changelist(Buyer),
        {"action": "issue_api_key", "_selected_action": [buyer.pk], "index": 0},
    )
    assert response.status_code == 200
    page = response.content.decode()
    key = ApiKey.objects.get(buyer=buyer)
    raw = page[page.index(f"tbk_{key.prefix}_") :].split("<")[0].strip()
    assert hashlib.sha256(raw.encode()).hexdigest() == key.key_hash
    assert key.label == "admin:root"
    # Shown on this page only: not left in a message cookie for the next request.
    assert not getattr(response.cookies.get("messages"), "value", "")
    detail = superuser.get(_change(buyer)).content.decode()
    assert key.prefix in detail and WALLET in detail
    assert raw not in detail and key.key_hash not in detail


def test_new_buyer_goes_through_the_service(superuser: Client) -> None:
    response = superuser.post(
        reverse("admin:purchases_buyer_add"),
        {
            "name": "agent-new",
            "spend_cap": "5000000",
            "wallets-TOTAL_FORMS": "1",
            "wallets-INITIAL_FORMS": "0",
            "wallets-0-address": WALLET.upper().replace("0X", "0x"),
            "api_keys-TOTAL_FORMS": "0",
            "api_keys-INITIAL_FORMS": "0",
        },
    )
    assert response.status_code == 302, response.content
    buyer = Buyer.objects.get(name="agent-new")
    assert buyer.ref.startswith("buy_") and buyer.spend_cap == 5_000_000
    assert list(buyer.wallets.values_list("address", flat=True)) == [WALLET]


def test_finance_tops_up_once_per_reference(world: World, finance: Client) -> None:
    buyer = world.prepaid.buyer
    assert buyer is not None
    url = reverse("admin:payments_ledgerentry_top_up")
    assert url in finance.get(_changelist(LedgerEntry)).content.decode()
    data = {"buyer": buyer.pk, "asset": USDC_LOCAL, "amount": "12.5", "reference": "bank-77"}
    told = []
    for _ in range(2):  # a double submit
        response = finance.post(url, data, follow=True)
        assert response.redirect_chain[-1][1] == 302
        told.append(" ".join(_messages(response)))
    # What each submit says is what it did: the second credited nothing.
    assert told[0].startswith("Credited 12.5") and "Credited" not in told[1]
    assert "top_up:bank-77 was already credited" in told[1] and "nothing more" in told[1]
    entry = LedgerEntry.objects.get(reference="top_up:bank-77")
    assert (entry.buyer_id, entry.amount, entry.kind) == (buyer.pk, 12_500_000, "top_up")
    assert entry.memo == "top-up by fay-finance"
    too_fine = finance.post(url, {**data, "amount": "1.0000001", "reference": "bank-78"})
    assert "This asset has 6 decimals." in too_fine.content.decode()
    assert not LedgerEntry.objects.filter(reference="top_up:bank-78").exists()


def test_a_top_up_too_large_for_the_ledger_is_refused_on_the_form(
    world: World, finance: Client
) -> None:
    """Hostile or mistyped input gets a clear answer, never a 500 (issue 33: a top-up of
    99999999999999999999 answered 500, "bigint out of range")."""
    buyer = world.prepaid.buyer
    assert buyer is not None
    url = reverse("admin:payments_ledgerentry_top_up")
    data = {"buyer": buyer.pk, "asset": USDC_LOCAL, "reference": "bank-huge"}
    for amount in ("99999999999999999999", "9223372036854.775807", "1e40"):
        page = finance.post(url, {**data, "amount": amount})
        assert page.status_code == 200, amount
        assert "the largest balance the ledger holds" in page.content.decode() or (
            "Ensure that there are no more than" in page.content.decode()
        ), amount
    assert not LedgerEntry.objects.filter(reference="top_up:bank-huge").exists()


def test_ledger_is_read_only_and_support_cannot_top_up(world: World, support: Client) -> None:
    entry = LedgerEntry.objects.order_by("pk").first()
    assert entry is not None
    assert support.post(_change(entry), {"amount": "1"}).status_code == 403
    url = reverse("admin:payments_ledgerentry_top_up")
    assert url not in support.get(_changelist(LedgerEntry)).content.decode()
    assert support.get(url).status_code == 403


def test_offering_is_editable(world: World, superuser: Client) -> None:
    offering = world.prepaid.offering
    page = superuser.get(_change(offering)).content.decode()
    for group in ("What is sold", "Price and payment", "Stock, delivery and remedies"):
        assert group in page
    assert 'name="price"' in page


def test_editing_an_offering_never_puts_back_stock_taken_meanwhile(superuser: Client) -> None:
    offering = OfferingFactory.create(with_stock=True)  # stock 2
    shown = model_to_dict(offering)
    # A quote takes one unit while the page is open (the service's conditional decrement).
    Offering.objects.filter(pk=offering.pk).update(stock=F("stock") - 1)
    form = {
        **{k: "" if v is None else v for k, v in shown.items() if k != "id"},
        "title": "Renamed",
        "input_schema": json.dumps(shown["input_schema"]),
        "volatile_fields": json.dumps(shown["volatile_fields"]),
        "result_retention": "7 00:00:00",
        "initial-stock": "2",
        **NO_UPSTREAM,
    }
    response = superuser.post(_change(offering), form)
    assert response.status_code == 302, response.content
    offering.refresh_from_db()
    assert (offering.title, offering.stock) == ("Renamed", 1)
    superuser.post(_change(offering), {**form, "stock": "10", "initial-stock": "1"})
    offering.refresh_from_db()
    assert offering.stock == 10  # a deliberate restock is written


# The upstream inline's management form, as the page posts it when no upstream is added.
NO_UPSTREAM = {"upstream-TOTAL_FORMS": "0", "upstream-INITIAL_FORMS": "0"}


def _offering_form(offering: Offering) -> dict[str, Any]:
    """The offering's change form as the admin shows it (the version is never posted)."""
    shown = model_to_dict(offering)
    return {
        **{k: "" if v is None else v for k, v in shown.items() if k not in ("id", "version")},
        "input_schema": json.dumps(shown["input_schema"]),
        "volatile_fields": json.dumps(shown["volatile_fields"]),
        "result_retention": "7 00:00:00",
        "duplicate_window": "00:10:00",
        "expected_run_time": "00:00:10",
        **NO_UPSTREAM,
    }


def test_changing_terms_bumps_the_version_and_a_title_does_not(superuser: Client) -> None:
    offering = OfferingFactory.create()
    form = _offering_form(offering)
    renamed = superuser.post(_change(offering), {**form, "title": "Renamed"})
    assert renamed.status_code == 302, renamed.content
    offering.refresh_from_db()
    assert (offering.title, offering.version) == ("Renamed", 1)  # not a term
    superuser.post(_change(offering), {**form, "title": "Renamed", "price": "300000"})
    offering.refresh_from_db()
    assert (offering.price, offering.version) == (300_000, 2)  # the terms changed
    # The version is shown, never typed: a posted one is ignored.
    superuser.post(_change(offering), {**form, "title": "Again", "price": "300000", "version": 9})
    offering.refresh_from_db()
    assert offering.version == 2


def test_an_offering_on_an_x402_network_is_paid_in_that_networks_token(
    superuser: Client, settings: Any
) -> None:
    token = "0x" + "7c" * 20
    network = dict(settings.X402_NETWORKS["eip155:31337"], token_address=token)
    settings.X402_NETWORKS = {**settings.X402_NETWORKS, "eip155:31337": network}
    offering = OfferingFactory.create(network="eip155:31337", asset="0x" + "a0" * 20)
    form = _offering_form(offering)
    refused = superuser.post(_change(offering), {**form, "price": "300000"})
    assert refused.status_code == 200
    assert f"the network&#x27;s token {token}" in refused.content.decode()
    offering.refresh_from_db()
    assert offering.price != 300_000  # nothing written
    accepted = superuser.post(
        _change(offering), {**form, "asset": token.upper().replace("0X", "0x")}
    )
    assert accepted.status_code == 302, accepted.content
    offering.refresh_from_db()
    assert offering.asset.lower() == token


def test_idempotency_record_shows_no_editable_response(world: World, superuser: Client) -> None:
    record = IdempotencyRecord.objects.get(scope="prepaid")
    page = superuser.get(_change(record)).content.decode()
    assert 'name="response_body"' not in page
    assert record.key in page


# --- roles --------------------------------------------------------------------------------
def _codenames(group: Group) -> set[str]:
    return set(group.permissions.values_list("codename", flat=True))


def test_roles_are_idempotent_and_exact() -> None:
    first = {name: _codenames(group) for name, group in roles_ensure().items()}
    Group.objects.get(name="finance").permissions.clear()
    second = {name: _codenames(group) for name, group in roles_ensure().items()}
    assert first == second
    assert Group.objects.filter(name__in=["support", "finance"]).count() == 2
    # Only view permissions: which fields and actions a role gets is backoffice.roles' table.
    assert second["finance"] == {
        "view_refund",
        "view_ledgerentry",
        "view_ledgerbalance",
        "view_exportbatch",
        "view_purchase",
        "view_purchaseevent",
        "view_paymentattempt",
        "view_payout",
        "view_refundrequest",  # finance reads the buyers' refund-request queue; support decides
    }
    support = second["support"]
    assert {"view_purchase", "view_refund", "view_ledgerentry", "view_result"} <= support
    assert {p for p in support if not p.startswith("view_")} == set()
    assert "view_exportbatch" not in support


def _upstream_fields(**fields: str) -> dict[str, str]:
    data = {
        "kind": "http",
        "url": "https://seller.example/work",
        "method": "POST",
        "timeout_seconds": "5",
        "input_mode": "json",
        "secret_env": "SELLER_WORK_SECRET",
        "definitive_statuses": "[422]",
        "max_result_bytes": "65536",
        "entry_point": "",
        "dry_run": "{}",
        **fields,
    }
    return {
        "upstream-TOTAL_FORMS": "1",
        "upstream-INITIAL_FORMS": "0",
        **{f"upstream-0-{k}": v for k, v in data.items()},
    }


def test_an_offering_gets_its_upstream_on_its_page_validated(superuser: Client) -> None:
    from fulfillment.models import Upstream

    offering = OfferingFactory.create()
    form = {**_offering_form(offering)}
    page = superuser.get(_change(offering)).content.decode()
    assert "upstream-TOTAL_FORMS" in page
    refused = superuser.post(_change(offering), {**form, **_upstream_fields(secret_env="sk_1")})
    assert refused.status_code == 200
    assert "not the secret" in refused.content.decode()
    assert not Upstream.objects.filter(offering=offering).exists()
    saved = superuser.post(_change(offering), {**form, **_upstream_fields()})
    assert saved.status_code == 302, saved.content
    upstream = Upstream.objects.get(offering=offering)
    assert (upstream.kind, upstream.secret_env, upstream.definitive_statuses) == (
        "http",
        "SELLER_WORK_SECRET",
        [422],
    )


def _saved_upstream_fields(upstream: Any, **fields: str) -> dict[str, str]:
    """The inline as the page posts it for the offering's existing upstream, edited."""
    shown = {"url": upstream.url, "timeout_seconds": str(upstream.timeout_seconds)}
    posted = _upstream_fields(
        **{**shown, "id": str(upstream.pk), "offering": str(upstream.offering_id), **fields}
    )
    return {**posted, "upstream-INITIAL_FORMS": "1"}


def test_an_upstream_change_is_recorded_with_who_and_what_and_moves_the_terms_version(
    superuser: Client,
) -> None:
    from fulfillment.models import Upstream
    from purchases.event_subjects import OFFERING_UPSTREAM_CHANGED

    offering = OfferingFactory.create()
    form = _offering_form(offering)
    events = PurchaseEvent.objects.filter(subject=OFFERING_UPSTREAM_CHANGED)

    added = superuser.post(_change(offering), {**form, **_upstream_fields()})
    assert added.status_code == 302, added.content
    offering.refresh_from_db()
    assert offering.version == 2  # where the work runs is part of the terms
    first = events.get()
    assert (first.actor_type, first.actor, first.reason_code) == ("staff", "root", "upstream_added")
    assert (first.from_state, first.to_state) == ("1", "2")
    assert first.evidence["offering"] == offering.slug
    assert first.evidence["changed"]["url"] == [None, "https://seller.example/work"]
    assert first.evidence["changed"]["secret_env"] == [None, "SELLER_WORK_SECRET"]

    upstream = Upstream.objects.get(offering=offering)
    secret_url = "https://seller:hunter2@seller.example/v2/work?token=sk_live_123"
    edited = superuser.post(
        _change(offering),
        {**form, **_saved_upstream_fields(upstream, url=secret_url, timeout_seconds="7.5")},
    )
    assert edited.status_code == 302, edited.content
    offering.refresh_from_db()
    assert offering.version == 3
    second = events.latest("pk")
    assert second.reason_code == "upstream_changed"
    # Only what changed, and never a credential the URL carried.
    assert second.evidence["changed"] == {
        "url": ["https://seller.example/work", "https://seller.example/v2/work?…"],
        "timeout_seconds": ["5", "7.5"],
    }
    assert "hunter2" not in json.dumps(second.evidence) and "sk_live" not in json.dumps(
        second.evidence
    )
    assert Upstream.objects.get(offering=offering).url == secret_url  # the row keeps it all

    # Saving the page untouched is no change: no event, the same version.
    upstream.refresh_from_db()
    again = superuser.post(_change(offering), {**form, **_saved_upstream_fields(upstream)})
    assert again.status_code == 302, again.content
    offering.refresh_from_db()
    assert (events.count(), offering.version) == (2, 3)

    # Support reads who changed what on the offering's page.
    page = html.unescape(superuser.get(_change(offering)).content.decode())
    assert "by root: version 2 → 3; url 'https://seller.example/work' -> " in page

    removed = superuser.post(
        _change(offering), {**form, **_saved_upstream_fields(upstream), "upstream-0-DELETE": "on"}
    )
    assert removed.status_code == 302, removed.content
    offering.refresh_from_db()
    assert not Upstream.objects.filter(offering=offering).exists()
    assert (offering.version, events.latest("pk").reason_code) == (4, "upstream_removed")
