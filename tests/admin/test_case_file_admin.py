"""The purchase case file through the real admin views, as support and finance, on
PostgreSQL: the Now box, the strip and the timeline per state; each action works, names
the staff member on the timeline, and answers 403 when not permitted or not safe; the
support filters; the dashboard."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from core.actors import Actor
from core.clock import utc_seconds
from payments.models import LedgerBalance, PaymentAttempt, Refund
from purchases import event_subjects
from purchases.events import event_note, purchase_transition
from purchases.models import (
    Escalation,
    IdempotencyRecord,
    Offering,
    OutboxMessage,
    Purchase,
    Quote,
)
from purchases.services.remedy.remedies import escalation_open
from purchases.services.settle.late_payments import settlement_unexpected
from tests.admin.test_admin import _change, _changelist, _messages, _paid_prepaid_purchase, _staff
from tests.admin.test_admin_scale import PURCHASE_PAGE_MAX_QUERIES
from tests.factories import (
    PAYER,
    SELLER,
    USDC_LOCAL,
    BuyerFactory,
    EscalationFactory,
    PaymentAttemptFactory,
    PurchaseFactory,
    RefundFactory,
    fund,
    refund_paid_back,
)

pytestmark = pytest.mark.django_db
WALLET = "0x" + "d4" * 20
TX = "0x" + "7e" * 32


@pytest.fixture
def support() -> Client:
    return _staff("sam-support", "support")


@pytest.fixture
def finance() -> Client:
    return _staff("fay-finance", "finance")


def _wire(valid_before: int) -> dict[str, Any]:
    return {
        "signature": "0x" + "11" * 65,
        "authorization": {
            "from": PAYER,
            "to": SELLER,
            "value": "250000",
            "validAfter": "0",
            "validBefore": str(valid_before),
            "nonce": "0x" + "22" * 32,
        },
    }


@dataclass
class Cases:
    done: Purchase  # prepaid, paid, work succeeded, result stored
    pending: Purchase  # x402 settlement pending, look-up overdue
    late: Purchase  # x402 failed, then its transfer landed: refund owed
    unknown: Purchase  # paid, work outcome unknown, escalated to support
    stalled: Purchase  # paid, queued past the sweep grace


@pytest.fixture
def cases(client_for_buyer: APIClient, offering: Offering) -> Cases:
    now = timezone.now()
    done = _paid_prepaid_purchase(client_for_buyer, offering)
    pending = PurchaseFactory.create(
        quote__offering=offering, settlement_pending=True, payer=WALLET,
        reason_code="awaiting_confirmations",
    )  # fmt: skip
    PaymentAttemptFactory.create(
        purchase=pending,
        pending=True,
        payer=WALLET,
        tx=TX,
        authorization=_wire(int(now.timestamp()) + 600),
        valid_before_at=now + timedelta(minutes=10),
        next_check_at=now - timedelta(seconds=5),
    )
    late = PurchaseFactory.create(quote__offering=offering, failed=True, payer=PAYER)
    attempt = PaymentAttemptFactory.create(purchase=late, failed=True, tx_hash="0x" + "9a" * 32)
    with transaction.atomic():
        locked = Purchase.objects.select_for_update().get(pk=late.pk)
        settlement_unexpected(
            purchase=locked, attempt=attempt, tx_hash=attempt.tx_hash or "", now=now,
            actor=Actor.system("test"),
        )  # fmt: skip
    unknown = PurchaseFactory.create(
        quote__offering=offering, paid=True, fulfillment_state="unknown",
        reason_code="job_status_unknown",
    )  # fmt: skip
    with transaction.atomic():
        escalation_open(
            purchase=unknown, owner="support", reason_code="execution_outcome_unknown",
            now=now, actor=Actor.system("test"),
        )  # fmt: skip
    stalled = PurchaseFactory.create(quote__offering=offering, paid=True)
    Purchase.objects.filter(pk=stalled.pk).update(updated_at=now - timedelta(minutes=5))
    return Cases(done, pending, late, unknown, stalled)


def _attr(page: str, testid: str, attr: str) -> str:
    match = re.search(rf'data-testid="{testid}"[^>]*{attr}="([^"]*)"', page)
    assert match, f"{testid} has no {attr}"
    return match.group(1)


def _current_stage(page: str) -> str:
    match = re.search(r'data-testid="case-stage-(\w+)"[^>]*data-current="true"', page)
    assert match
    return match.group(1)


def _action_url(purchase: Purchase, action: str) -> str:
    return reverse("admin:purchases_purchase_case_action", args=[purchase.pk, action])


# --- the page ------------------------------------------------------------------------------
def test_now_box_strip_and_timeline_in_each_state(cases: Cases, support: Client) -> None:
    expected = {
        # purchase: (owner, current stage, a phrase of the sentence, actions offered)
        "done": ("buyer", "execute", "Paid and done", {"redeliver_result", "propose_refund"}),
        "pending": ("reconciliation", "settle", "mined", {"recheck_settlement", "assign"}),
        "late": ("finance", "remedy", "landed anyway", {"assign"}),
        "unknown": ("support", "remedy", "may or may not have run", {"resolve"}),
        "stalled": ("reconciliation", "execute", "queued", {"reconcile_execution"}),
    }
    for name, (owner, stage, phrase, actions) in expected.items():
        purchase = getattr(cases, name)
        page = support.get(_change(purchase)).content.decode()
        assert _attr(page, "case-owner", "data-owner") == owner, name
        assert _current_stage(page) == stage, name
        sentence = re.search(r'data-testid="case-sentence">([^<]*)<', page)
        assert sentence and phrase in sentence.group(1), name
        offered = set(re.findall(r'data-testid="case-action-(\w+)"', page))
        assert actions <= offered, (name, offered)
        assert "approve_refund" not in offered  # finance's, never support's
        rows = re.findall(r'data-testid="case-event"', page)
        assert len(rows) == purchase.events.count(), name
        assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", page), name


def _replay(client: APIClient, purchase: Purchase) -> None:
    """The waiting buyer's poll: the same payment id and request again."""
    again = client.post(
        f"/api/v1/quotes/{purchase.quote.public_id}/purchase",
        {"rail": "prepaid"},
        format="json",
        HTTP_IDEMPOTENCY_KEY="pay-admin-0001-aaaa",  # _paid_prepaid_purchase's
    )
    assert again["Idempotent-Replayed"] == "true"


def test_a_polling_buyers_replays_fold_into_one_row_with_a_count_and_first_last_time(
    client_for_buyer: APIClient,
    offering: Offering,
    support: Client,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    purchase = _paid_prepaid_purchase(client_for_buyer, offering)
    start = timezone.now().replace(microsecond=0) + timedelta(minutes=1)
    clock = [start]
    monkeypatch.setattr(timezone, "now", lambda: clock[0])  # a buyer polling every 10 s
    for _ in range(5):
        _replay(client_for_buyer, purchase)
        clock[0] += timedelta(seconds=10)
    event_note(
        subject=event_subjects.RESULT_REACCESSED,
        purchase=purchase,
        actor=Actor.agent("buyer"),
        evidence={"channel": "api"},
    )
    for _ in range(2):
        _replay(client_for_buyer, purchase)
        clock[0] += timedelta(seconds=10)

    page = support.get(_change(purchase)).content.decode()

    rows = re.findall(r'<tr id="case-event-\d+"[^>]*>.*?</tr>', page, re.S)
    folded = [r for r in rows if 'data-subject="payment_id.replayed"' in r]
    assert len(folded) == 2  # the event between them ends the first run
    assert len(rows) == purchase.events.count() - (5 - 1) - (2 - 1)
    first, second = folded
    assert 'data-count="5"' in first and 'data-count="2"' in second
    assert "(5 times)" in first and "(2 times)" in second

    def at(seconds: int) -> str:
        return utc_seconds(start + timedelta(seconds=seconds))

    assert at(0) in first and at(40) in first  # first and last time
    assert at(50) in second and at(60) in second


def _page_queries(client: Client, purchase: Purchase) -> int:
    url = _change(purchase)
    client.get(url)  # warms the process's ContentType cache, as any running server has it
    with CaptureQueriesContext(connection) as queries:
        assert client.get(url).status_code == 200
    return len(queries.captured_queries)


@pytest.mark.postgres
def test_the_page_reads_each_table_once_whatever_the_case_holds(
    cases: Cases, superuser: Client, support: Client, finance: Client
) -> None:
    """Session, user, the purchase with its joins (quote, offering, buyer, result, receipt),
    one query per table the case file shows (attempts, executions, refunds, escalations,
    events) and a buyer's balance: none per row, in the Now box, the strip, the timeline or
    the inlines. A support or finance user costs what a superuser does: their groups and
    permissions are read with the user (core.auth), not three reads more."""
    seen = {}
    for name in ("done", "pending", "late", "unknown", "stalled"):
        purchase = getattr(cases, name)
        clients = {"superuser": superuser, "support": support, "finance": finance}
        seen[name] = {role: _page_queries(client, purchase) for role, client in clients.items()}
    for name, counts in seen.items():
        assert counts["support"] == counts["finance"] == counts["superuser"], (name, seen)
        assert counts["superuser"] <= PURCHASE_PAGE_MAX_QUERIES, (name, seen)
    before = _page_queries(support, cases.late)
    for _ in range(3):
        attempt = PaymentAttemptFactory.create(purchase=cases.late, failed=True, tx=TX)
        RefundFactory.create(payment_attempt=attempt)  # each a late transfer owed back
        EscalationFactory.create(purchase=cases.late)
        EscalationFactory.create(purchase=cases.late, resolved=True)
    page = support.get(_change(cases.late)).content.decode()
    assert page.count("late transfer: refund owed") == 4  # each attempt's row
    assert _page_queries(support, cases.late) == before


def test_deadline_is_absolute_to_the_second_and_relative(cases: Cases, support: Client) -> None:
    page = support.get(_change(cases.unknown)).content.decode()
    escalation = cases.unknown.escalations.get()
    deadline = escalation.deadline_at.strftime("%Y-%m-%d %H:%M:%S UTC")
    block = re.search(r'data-testid="case-deadline"[^>]*>([^<]*)<', page)
    assert block and deadline in block.group(1)
    assert re.search(r"\(in 3 h \d\d min\)", block.group(1))  # four hours, less the setup


def test_late_transfer_shows_in_the_header_and_on_the_attempt_row(
    cases: Cases, support: Client
) -> None:
    page = support.get(_change(cases.late)).content.decode()
    assert 'data-testid="case-late-transfer"' in page
    assert "late transfer: refund owed" in page  # the attempt row's column
    assert "Late transfer landed after the purchase failed" in page  # the timeline label
    assert "0.250000 USDC (250000)" in page  # decimal with atomic units beside it


def _state(page: str) -> str:
    """The Now box's State line as support reads it."""
    block = re.search(r'data-testid="case-finality"[^>]*>(.*?)</dd>', page, re.S)
    assert block
    return " ".join(re.sub(r"<[^>]+>", "", block.group(1)).split())


def test_a_late_transfer_says_what_can_still_change(cases: Cases, support: Client) -> None:
    """The refused authorization landed: it cannot land again. Only a new payment while the
    quote is open can still change the purchase, then it is final; the refund stays open
    until finance pays it back."""
    late, quote = cases.late, cases.late.quote
    page = support.get(_change(late)).content.decode()
    until = quote.expires_at.strftime("%Y-%m-%d %H:%M:%S UTC")
    assert _state(page) == f"can change until {until}, final after, refund open"
    assert "quote is open for a new payment" in page
    Quote.objects.filter(pk=quote.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    page = support.get(_change(late)).content.decode()
    assert _state(page) == "final, refund open"  # not "can change until" the failure's 24 h
    assert _attr(page, "case-finality", "data-finality") == "final"
    assert _attr(page, "case-finality", "data-refund-open") == "true"
    assert _attr(page, "case-owner", "data-owner") == "finance"
    refund_paid_back(late.refunds.get(), "0x" + "ab" * 32)
    page = support.get(_change(late)).content.decode()
    assert _state(page) == "final"
    assert _attr(page, "case-owner", "data-owner") == "none"  # the buyer can no longer pay


def test_a_settled_purchase_with_a_refund_owed_is_final_with_the_refund_open(
    offering: Offering, support: Client
) -> None:
    purchase = PurchaseFactory.create(quote__offering=offering, executed=True)
    # Refused first, paid by a second authorization; then the first landed too.
    refused = PaymentAttemptFactory.create(purchase=purchase, failed=True)
    PaymentAttemptFactory.create(purchase=purchase, succeeded=True)
    refund = RefundFactory.create(payment_attempt=refused, reason_code="duplicate_settlement")
    page = support.get(_change(purchase)).content.decode()
    # The purchase is settled (final); the page says its remedy is still open.
    assert _state(page) == "final, refund open"
    assert _attr(page, "case-finality", "data-finality") == "final"
    refund_paid_back(refund, "0x" + "cd" * 32)
    page = support.get(_change(purchase)).content.decode()
    assert _state(page) == "final"
    assert _attr(page, "case-finality", "data-refund-open") == "false"


def test_tx_hash_links_to_the_networks_explorer(offering: Offering, support: Client) -> None:
    sepolia = Offering.objects.create(
        slug="sepolia-report", title="t", price=250_000, asset=offering.asset,
        network="eip155:84532", pay_to=SELLER, executor="report",
    )  # fmt: skip
    purchase = PurchaseFactory.create(quote__offering=sepolia, settlement_pending=True)
    PaymentAttemptFactory.create(purchase=purchase, pending=True, tx=TX)
    page = support.get(_change(purchase)).content.decode()
    assert f'href="https://sepolia.basescan.org/tx/{TX}"' in page
    local = PurchaseFactory.create(quote__offering=offering, settlement_pending=True)
    PaymentAttemptFactory.create(purchase=local, pending=True, tx="0x" + "5b" * 32)
    assert "basescan" not in support.get(_change(local)).content.decode()  # anvil: none


def test_prepaid_page_shows_the_buyers_balance(cases: Cases, support: Client) -> None:
    balance = LedgerBalance.objects.get(buyer=cases.done.buyer).amount
    page = support.get(_change(cases.done)).content.decode()
    assert f"({balance})" in re.search(r'data-testid="case-balance">([^<]*)<', page).group(1)  # type: ignore[union-attr]


def test_refused_prepaid_payment_is_found_by_its_payment_id_with_the_balance(
    make_client: Any, offering: Offering, support: Client
) -> None:
    poor = BuyerFactory.create()
    fund(poor, 100_000)
    client = make_client(poor)
    quote = client.post(
        "/api/v1/quotes", {"offering": offering.slug, "input": {"title": "x", "csv": "a\n1\n"}},
        format="json",
    )  # fmt: skip
    refused = client.post(
        f"/api/v1/quotes/{quote.json()['id']}/purchase", {"rail": "prepaid"}, format="json",
        HTTP_IDEMPOTENCY_KEY="pay-refused-000001",
    )  # fmt: skip
    assert refused.status_code == 402
    assert refused.json()["purchase"] is None  # the API gives no purchase reference
    listing = support.get(_changelist(IdempotencyRecord), {"q": "pay-refused-000001"})
    record = IdempotencyRecord.objects.get(key="pay-refused-000001")
    assert listing.context["cl"].result_count == 1
    page = support.get(_change(record)).content.decode()
    assert "insufficient_funds" in page
    assert "0.100000 USDC (100000)" in page
    # Told in words, not only as the stored JSON: what the buyer heard and whose move it is.
    assert (
        "<strong>402 insufficient_funds</strong>: The prepaid balance does not cover the price. "
        "Nothing was charged: no purchase was made.<br>Next: top up balance (the buyer's "
        "move)." in page
    )


# --- the actions ----------------------------------------------------------------------------
def test_recheck_settlement_runs_the_look_up_and_names_the_staff_member(
    cases: Cases, support: Client, settings: Any
) -> None:
    networks = {**settings.X402_NETWORKS}
    # A chain that does not answer (nothing listens on port 9): the look-up says so.
    networks["eip155:31337"] = {
        **networks["eip155:31337"],
        "rpc_url": "http://127.0.0.1:9",
        "token_address": USDC_LOCAL,
    }
    settings.X402_NETWORKS = networks
    done = support.post(_action_url(cases.pending, "recheck_settlement"))
    assert done.status_code == 302, done.content
    event = cases.pending.events.get(subject="case.settlement_rechecked")
    assert (event.actor_type, event.actor) == ("staff", "sam-support")
    assert event.evidence["status"] == "pending"
    assert event.evidence["reason_code"] == "chain_unavailable"
    assert _messages(done) == ["Settlement looked up: pending."]  # type: ignore[arg-type]


def test_reconcile_execution_stages_stalled_work_once(cases: Cases, support: Client) -> None:
    OutboxMessage.objects.all().delete()
    done = support.post(_action_url(cases.stalled, "reconcile_execution"))
    assert done.status_code == 302
    assert (
        OutboxMessage.objects.filter(
            job="purchase_execute", kwargs={"purchase_id": cases.stalled.pk}
        ).count()
        == 1
    )
    event = cases.stalled.events.get(subject="case.execution_reconciled")
    assert event.actor == "sam-support" and event.evidence["staged"] is True


def test_reconcile_unknown_work_inspects_the_saved_job(cases: Cases, support: Client) -> None:
    done = support.post(_action_url(cases.unknown, "reconcile_execution"))
    assert done.status_code == 302
    event = cases.unknown.events.get(subject="case.execution_reconciled")
    assert event.evidence == {"job_ref": "", "job_status": "never_started"}
    cases.unknown.refresh_from_db()
    assert cases.unknown.fulfillment_state == "unknown"  # inspected, never guessed


def test_redeliver_hands_staff_the_capability_link(
    cases: Cases, support: Client, settings: Any
) -> None:
    settings.TOLLBOOTH_PUBLIC_URL = "https://api.seller.example"
    done = support.post(_action_url(cases.done, "redeliver_result"))
    assert done.status_code == 302
    event = cases.done.events.get(subject="case.result_redelivered")
    assert event.actor == "sam-support"
    # A link support can send as it is: with the host buyers reach (issue 33: none).
    url = event.evidence["url"]
    assert url.startswith(f"https://api.seller.example/x402/purchases/{cases.done.ref}/")
    assert url in _messages(done)[0]
    fetched = APIClient().get(url.removeprefix("https://api.seller.example"))
    assert fetched.status_code == 200


def test_actions_not_safe_now_are_refused(cases: Cases, support: Client) -> None:
    events = {p.pk: p.events.count() for p in (cases.done, cases.pending, cases.stalled)}
    assert support.post(_action_url(cases.done, "reconcile_execution")).status_code == 403
    assert support.post(_action_url(cases.done, "recheck_settlement")).status_code == 403
    assert support.post(_action_url(cases.pending, "redeliver_result")).status_code == 403
    assert support.post(_action_url(cases.stalled, "resolve")).status_code == 403
    assert support.post(_action_url(cases.done, "no_such_action")).status_code == 403
    assert {p.pk: p.events.count() for p in (cases.done, cases.pending, cases.stalled)} == events


def test_actions_need_their_permission(cases: Cases, finance: Client, support: Client) -> None:
    assert finance.post(_action_url(cases.stalled, "reconcile_execution")).status_code == 403
    assert finance.post(_action_url(cases.unknown, "assign")).status_code == 403
    page = finance.get(_change(cases.stalled)).content.decode()
    assert 'data-testid="case-action-reconcile_execution"' not in page
    assert not OutboxMessage.objects.filter(kwargs={"purchase_id": cases.stalled.pk}).exists()


def test_assign_sets_owner_deadline_and_note(cases: Cases, support: Client) -> None:
    url = _action_url(cases.pending, "assign")
    assert 'name="deadline_at"' in support.get(url).content.decode()
    deadline = (timezone.now() + timedelta(hours=2)).replace(microsecond=0)
    done = support.post(
        url,
        {
            "owner": "finance",
            "deadline_at": deadline.strftime("%Y-%m-%d %H:%M:%S"),
            "note": "Buyer says the transfer is in their wallet history.",
            "escalation": "",
        },
    )
    assert done.status_code == 302, done.content
    escalation = cases.pending.escalations.get(state="open")
    assert (escalation.owner, escalation.reason_code, escalation.deadline_at) == (
        "finance",
        "staff_escalated",
        deadline,
    )
    assert (escalation.assigned_by, escalation.note[:5]) == ("sam-support", "Buyer")
    event = cases.pending.events.get(subject="escalation.assigned")
    assert event.actor == "sam-support" and event.evidence["owner"] == "finance"
    page = support.get(_change(cases.pending)).content.decode()
    assert _attr(page, "case-owner", "data-owner") == "finance"
    # One is open now: the form offers it first and selected, so a person re-assigning as
    # offered moves that one instead of opening a second (issue 33: a new one by default).
    form = support.get(url).content.decode()
    options = re.findall(
        r'<option value="([^"]*)"( selected)?>', form.split('name="escalation"')[1]
    )
    assert options[0] == (str(escalation.pk), " selected")
    assert ("", "") in options  # a new one stays on offer
    later = deadline + timedelta(hours=1)
    again = support.post(
        url,
        {
            "owner": "support",
            "deadline_at": later.strftime("%Y-%m-%d %H:%M:%S"),
            "note": "Taken over.",
            "escalation": options[0][0],
        },
    )
    assert again.status_code == 302, again.content
    assert cases.pending.escalations.get(state="open").deadline_at == later


def test_assigning_to_support_while_a_refund_is_owed_keeps_the_refund_finances(
    cases: Cases, support: Client, finance: Client
) -> None:
    purchase = cases.late  # a late transfer: a refund owed, finance's move
    refund = purchase.refunds.get()
    assert _attr(finance.get(_change(purchase)).content.decode(), "case-owner", "data-owner") == (
        "finance"
    )
    deadline = (timezone.now() + timedelta(hours=2)).replace(microsecond=0)
    done = support.post(
        _action_url(purchase, "assign"),
        {
            "owner": "support",
            "deadline_at": deadline.strftime("%Y-%m-%d %H:%M:%S"),
            "note": "Buyer asks about it; support answers them.",
            "escalation": "",
        },
    )
    assert done.status_code == 302, done.content
    assert purchase.escalations.get(state="open").owner == "support"
    # Finance's lists still hold the refund owed.
    owed = finance.get(reverse("admin:payments_refund_changelist"), {"state": "owed"})
    assert refund in owed.context["cl"].result_list
    listed = finance.get(_changelist(Purchase), {"refund_owed": "yes"})
    assert purchase in listed.context["cl"].result_list
    # The Now box names both moves: support's escalation with its deadline, and finance's
    # refund owed (it said "support" alone), with the link finance pays it back from.
    for client in (support, finance):
        page = client.get(_change(purchase)).content.decode()
        assert _attr(page, "case-owner", "data-owner") == "support"
        assert _attr(page, "case-deadline", "data-deadline-source") == "escalation"
        assert _attr(page, "case-refund-owner", "data-owner") == "finance"
        assert "finance: refund owed, to pay back" in page
    assert f"Pay back refund {refund.pk} (owed)" in page  # finance's page
    # Resolved, the escalation leaves the refund finance's alone again.
    escalation = purchase.escalations.get(state="open")
    resolved = support.post(
        _action_url(purchase, "resolve"),
        {"escalation": escalation.pk, "code": "buyer_informed", "note": "Told them."},
    )
    assert resolved.status_code == 302, resolved.content
    page = finance.get(_change(purchase)).content.decode()
    assert _attr(page, "case-owner", "data-owner") == "finance"
    assert 'data-testid="case-refund-owner"' not in page


def test_assign_refuses_a_deadline_in_the_past(cases: Cases, support: Client) -> None:
    past = (timezone.now() - timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S")
    answer = support.post(
        _action_url(cases.pending, "assign"),
        {"owner": "support", "deadline_at": past, "note": "x", "escalation": ""},
    )
    assert answer.status_code == 403
    assert not cases.pending.escalations.exists()


def test_proposed_refund_is_owed_only_after_finance_approves(
    cases: Cases, support: Client, finance: Client, client_for_buyer: APIClient
) -> None:
    purchase = cases.done
    balance = LedgerBalance.objects.get(buyer=purchase.buyer).amount
    done = support.post(
        _action_url(purchase, "propose_refund"),
        {"kind": "compensation", "amount": "0.10", "note": "Report arrived late."},
    )
    assert done.status_code == 302, done.content
    refund = Refund.objects.get(purchase=purchase, reason_code="support_compensation")
    assert (refund.state, refund.amount, refund.proposed_by) == ("proposed", 100_000, "sam-support")
    assert LedgerBalance.objects.get(buyer=purchase.buyer).amount == balance  # nothing moved
    assert not Refund.objects.filter(state="owed", purchase=purchase).exists()
    dashboard = finance.get(reverse("admin:purchases_purchase_dashboard"))
    assert dashboard.context["figures"]["refunds_proposed"] == [refund]
    # The buyer is told nothing about a proposal.
    status = client_for_buyer.get(f"/api/v1/purchases/{purchase.ref}").json()
    assert (status["remedy"]["state"], status["remedy"]["refunds"]) == ("none", [])
    approve = _action_url(purchase, "approve_refund")
    assert support.post(approve, {"refund": refund.pk, "decision": "approve"}).status_code == 403
    assert (
        'data-testid="case-action-approve_refund"'
        in finance.get(_change(purchase)).content.decode()
    )
    decided = finance.post(approve, {"refund": refund.pk, "decision": "approve"})
    assert decided.status_code == 302, decided.content
    refund.refresh_from_db()
    # Prepaid: approved means credited to the balance at once.
    assert (refund.state, refund.decided_by) == ("paid", "fay-finance")
    assert LedgerBalance.objects.get(buyer=purchase.buyer).amount == balance + 100_000
    moves = list(
        purchase.events.filter(subject="refund").values_list("from_state", "to_state", "actor")
    )
    assert moves == [
        ("", "proposed", "sam-support"),
        ("proposed", "owed", "fay-finance"),
        ("owed", "paid", "fay-finance"),
    ]
    # Decided once: a second approval is not offered and is refused.
    assert finance.post(approve, {"refund": refund.pk, "decision": "approve"}).status_code == 403


def test_resolve_with_a_reason_code_from_the_list(cases: Cases, support: Client) -> None:
    escalation = cases.unknown.escalations.get()
    url = _action_url(cases.unknown, "resolve")
    bad = support.post(url, {"escalation": escalation.pk, "code": "made_up", "note": ""})
    assert bad.status_code == 200  # the form says the choice is not valid
    escalation.refresh_from_db()
    assert escalation.state == "open"
    # The system's own closing codes are neither offered to a person nor taken from one.
    page = support.get(url).content.decode()
    assert 'value="buyer_informed"' in page
    for automatic in ("execution_completed_on_recheck", "execution_failed_on_recheck"):
        assert f'value="{automatic}"' not in page
        forged = support.post(url, {"escalation": escalation.pk, "code": automatic, "note": ""})
        assert forged.status_code == 200
        escalation.refresh_from_db()
        assert escalation.state == "open"
    done = support.post(
        url, {"escalation": escalation.pk, "code": "buyer_informed", "note": "Told the agent."}
    )
    assert done.status_code == 302
    escalation.refresh_from_db()
    assert (escalation.state, escalation.resolution_code, escalation.resolved_by) == (
        "resolved",
        "buyer_informed",
        "sam-support",
    )
    event = cases.unknown.events.filter(subject="escalation").order_by("pk").last()
    assert event and (event.to_state, event.actor) == ("resolved", "sam-support")


# --- queues, filters and the list -----------------------------------------------------------
def _refs(client: Client, **params: str) -> set[str]:
    response = client.get(_changelist(Purchase), params)
    assert response.status_code == 200
    return {p.ref for p in response.context["cl"].result_list}


def test_purchase_filters(cases: Cases, support: Client) -> None:
    assert _refs(support, open_escalation="yes") == {cases.unknown.ref}
    assert _refs(support, refund_owed="yes") == {cases.late.ref}
    assert _refs(support, stuck="yes") == {cases.pending.ref, cases.stalled.ref}
    assert _refs(support, buyer_ref=cases.done.buyer.ref) == {cases.done.ref}  # type: ignore[union-attr]
    assert _refs(support, payer_wallet=WALLET.upper().replace("0X", "0x")) == {cases.pending.ref}


def test_state_columns_stay_in_a_narrow_list(cases: Cases, support: Client) -> None:
    page = support.get(_changelist(Purchase)).content.decode()
    headers = re.findall(r'<th scope="col" class="[^"]*?(column-[\w-]+)', page)
    assert {"column-payment_state", "column-fulfillment_state"} <= set(headers)
    assert len(headers) <= 8  # with the checkbox: fits 1366 px


def test_escalations_overdue_first_with_owner_and_deadline(cases: Cases, support: Client) -> None:
    overdue = Escalation.objects.create(
        purchase=cases.stalled, owner="finance", reason_code="late_one",
        deadline_at=timezone.now() - timedelta(hours=1),
    )  # fmt: skip
    listing = support.get(_changelist(Escalation))
    first = listing.context["cl"].result_list[0]
    assert first == overdue
    page = listing.content.decode()
    assert overdue.deadline_at.strftime("%Y-%m-%d %H:%M:%S UTC") in page


# --- the dashboard ----------------------------------------------------------------------------
def test_dashboard_figures(cases: Cases, support: Client) -> None:
    Escalation.objects.create(
        purchase=cases.stalled, owner="support", reason_code="late_one",
        deadline_at=timezone.now() - timedelta(minutes=1),
    )  # fmt: skip
    assert (
        reverse("admin:purchases_purchase_dashboard")
        in support.get(reverse("admin:index")).content.decode()
    )
    response = support.get(reverse("admin:purchases_purchase_dashboard"))
    assert response.status_code == 200
    figures = response.context["figures"]
    pending = PaymentAttempt.objects.get(purchase=cases.pending)
    assert figures["oldest_pending"] == pending
    assert figures["unknown_count"] == 1
    assert figures["overdue_count"] == 1
    [owed] = figures["refunds_owed"]
    assert (str(owed["amount"]), owed["symbol"], owed["count"]) == ("0.250000", "USDC", 1)
    assert figures["refunds_proposed"] == []
    today = response.context["chart"]["bars"][-1]
    assert today["total"] == Purchase.objects.count()
    page = response.content.decode()
    assert "<svg" in page and "0.250000 USDC (250000)" in page


def test_stale_reason_code_clears_when_the_state_moves(cases: Cases) -> None:
    purchase = cases.pending
    with transaction.atomic():
        locked = Purchase.objects.select_for_update().get(pk=purchase.pk)
        # The caller names no update_fields: what the transition assigned is saved anyway.
        purchase_transition(
            purchase=locked,
            transition=locked.payment_complete,
            actor=Actor.system("test"),
            arguments={"paid_at": timezone.now()},
        )
    purchase.refresh_from_db()
    assert (purchase.payment_state, purchase.reason_code) == ("paid", "")
    assert purchase.paid_at is not None
    assert purchase.events.filter(subject="purchase.payment", to_state="paid").exists()


def test_a_pending_case_reads_the_attempts_current_reason(cases: Cases, support: Client) -> None:
    # Reconciliation updates the attempt's reason on every look-up; the purchase keeps the
    # one it was parked with. The header follows the attempt, as its row does.
    PaymentAttempt.objects.filter(purchase=cases.pending).update(reason_code="not_on_chain_yet")
    page = support.get(_change(cases.pending)).content.decode()
    sentence = re.search(r'data-testid="case-sentence">([^<]*)<', page)
    # It was broadcast (its tx hash is on the page): not "no broadcast of it is known".
    assert sentence and "nonce unused" in sentence.group(1)
    assert f"Broadcast (tx {TX})" in sentence.group(1)
    assert _attr(page, "case-deadline", "data-deadline-source") == "authorization_window"


def _warning(page: str) -> str:
    match = re.search(r'data-testid="case-action-warning">(.*?)</p>', page, re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", match.group(1))) if match else ""


def test_refunding_an_unknown_outcome_is_offered_with_a_warning_that_names_the_risk(
    cases: Cases, support: Client, finance: Client
) -> None:
    purchase = cases.unknown
    PaymentAttemptFactory.create(purchase=purchase, succeeded=True, amount=purchase.amount)
    propose = _action_url(purchase, "propose_refund")
    warning = _warning(support.get(propose).content.decode())
    # What is awaited, and what refunding now risks.
    assert "outcome is still unknown (job_status_unknown)" in warning
    assert "awaiting the executor's answer" in warning
    assert "result is delivered to the buyer and this refund stands" in warning
    assert "never paid twice" in warning and "docs/runbook.md" in warning
    # Still offered: support proposes, finance decides, and reads the same warning first.
    assert support.post(propose, {"kind": "refund", "note": "Buyer gave up."}).status_code == 302
    approve = finance.get(_action_url(purchase, "approve_refund")).content.decode()
    assert _warning(approve) == warning
    # Where the outcome is known, nothing to warn of.
    assert _warning(support.get(_action_url(cases.done, "propose_refund")).content.decode()) == ""


def test_a_declined_proposal_moves_nothing_and_partial_ones_never_exceed_the_payment(
    cases: Cases, support: Client, finance: Client
) -> None:
    purchase = cases.done
    propose = _action_url(purchase, "propose_refund")
    support.post(propose, {"kind": "refund", "note": "Wrong report."})
    refund = Refund.objects.get(purchase=purchase, reason_code="support_refund")
    balance = LedgerBalance.objects.get(buyer=purchase.buyer).amount
    declined = finance.post(
        _action_url(purchase, "approve_refund"), {"refund": refund.pk, "decision": "decline"}
    )
    assert declined.status_code == 302
    refund.refresh_from_db()
    assert (refund.state, refund.decided_by) == ("declined", "fay-finance")
    assert LedgerBalance.objects.get(buyer=purchase.buyer).amount == balance
    # The declined refund returned nothing: a new proposal may return it all, once.
    assert support.post(propose, {"kind": "refund", "note": "Again."}).status_code == 302
    proposed = Refund.objects.get(purchase=purchase, reason_code="support_refund", state="proposed")
    assert proposed.amount == purchase.amount
    assert support.post(propose, {"kind": "refund", "note": "Twice."}).status_code == 403
    more = support.post(propose, {"kind": "compensation", "amount": "0.05", "note": "More."})
    assert more.status_code == 403
    assert not Refund.objects.filter(purchase=purchase, reason_code="support_compensation")


def test_the_now_box_shows_the_next_automatic_check_and_finance_the_owed_refund(
    cases: Cases, support: Client, finance: Client
) -> None:
    """Every unfinished state names the next automatic check with its time; finance, on a
    purchase whose refund is owed, gets a link to pay it back, not "no action"."""
    page = support.get(_change(cases.pending)).content.decode()
    check = re.search(r'data-testid="case-next-check"[^>]*>\s*([^<]*?)\s*</dd>', page, re.S)
    assert check and re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(overdue by", check.group(1))
    assert "settlement look-up" in check.group(1)
    assert _attr(page, "case-deadline", "data-deadline-source") == "settlement_escalation"
    late = finance.get(_change(cases.late)).content.decode()
    refund = cases.late.refunds.get()
    assert f"?state=owed&amp;q={cases.late.ref}" in late
    assert f"Pay back refund {refund.pk} (owed)" in late
    assert 'data-testid="case-no-actions"' not in late
