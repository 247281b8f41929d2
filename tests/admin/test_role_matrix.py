"""Fields by role, proven through the real admin views: role x model x field, and x action.

One world is seeded with a distinctive value in every field worth proving (MARKS). For each
(role, model, field) the value must be on the role's pages (change page, list, the parent's
page where the model is an inline) exactly where a superuser's pages show it, or nowhere at
all; and a search by it must find the row only when the role sees the field and the admin
searches by it. The expectations (MARKS' `seen_by`, ACTIONS' `allowed`) are written here by
hand from the issue, independently of backoffice.roles' table; the table is also walked, so
a field it names without a mark still gets a structural check (its column or row on the page).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth.models import Group, User
from django.db import transaction
from django.db.models import Model
from django.test import Client
from django.urls import reverse
from django.utils import formats, timezone

from backoffice.admin.case_file import CASE_EVIDENCE_NAMES
from backoffice.roles import NEVER_SHOWN, ROLE_TABLE, roles_ensure
from core.admin import RoleScopedAdmin
from fulfillment.models import ExecutionAttempt, Receipt, Result
from payments.models import (
    ExportBatch,
    LedgerBalance,
    LedgerEntry,
    PaymentAttempt,
    Payout,
    Refund,
)
from purchases.models import (
    ApiKey,
    Buyer,
    BuyerWallet,
    Escalation,
    IdempotencyRecord,
    JobRun,
    Offering,
    Purchase,
    PurchaseEvent,
    RefundRequest,
)
from purchases.services.remedy.case_actions import case_refund_propose
from tests.admin.test_case_file_admin import Cases
from tests.factories import OfferingFactory, PurchaseFactory

SUPPORT, FINANCE, SUPERUSER = "support", "finance", "superuser"
ROLES = (SUPPORT, FINANCE, SUPERUSER)
ALL = frozenset(ROLES)
SU = frozenset({SUPPORT, SUPERUSER})
FU = frozenset({FINANCE, SUPERUSER})
ONLY_SUPERUSER = frozenset({SUPERUSER})
NOBODY: frozenset[str] = frozenset()


def _at(day: int) -> datetime:
    # A date of its own per field: admin pages render datetimes to the minute.
    return datetime(2041, 1, 1, 3, 4, tzinfo=UTC) + timedelta(days=day * 37)


@dataclass(frozen=True)
class Mark:
    label: str
    field: str
    value: Any  # what is stored
    seen_by: frozenset[str]  # the independent expectation

    @property
    def shown(self) -> str:
        """The value as the admin renders it."""
        if isinstance(self.value, datetime):
            return str(formats.localize(timezone.localtime(self.value)))
        if isinstance(self.value, dict):
            return str(self.value["mark"])
        if isinstance(self.value, bytes):
            return self.value.decode()
        return str(self.value)


def _m(label: str, field: str, value: Any, seen_by: frozenset[str]) -> Mark:
    return Mark(label, field, value, seen_by)


MARKS = [
    # What is sold and who buys it: support reads them, finance has no need.
    _m("purchases.offering", "slug", "mark-offering-slug", SU),
    _m("purchases.offering", "description", "mark-offering-description", SU),
    _m("purchases.buyer", "name", "Mark Buyer Name", SU),
    _m("purchases.buyerwallet", "address", "0x" + "b1" * 20, SU),
    _m("purchases.apikey", "prefix", "mkpfx01", SU),
    _m("purchases.apikey", "label", "mark-key-label", SU),
    _m("purchases.apikey", "key_hash", "c0ffee" * 10 + "c0ff", NOBODY),  # key material
    # The buyer's input: support explains from it, finance never sees it.
    _m("purchases.quote", "canonical_input", {"mark": "mark-quote-input"}, SU),
    _m("purchases.quote", "input_hash", "mark-input-hash", SU),
    _m("purchases.quote", "quote_key", "mark-quote-key", SU),
    # The purchase: money and states for both; the result's digest for support only.
    _m("purchases.purchase", "payer", "0x" + "d1" * 20, ALL),
    _m("purchases.purchase", "amount", 123456789, ALL),
    _m("purchases.purchase", "paid_at", _at(1), ALL),
    _m("purchases.purchase", "reason_code", "mark_purchase_reason", ALL),
    _m("purchases.purchase", "result_sha256", "e1" * 32, SU),
    _m("purchases.purchase", "result_size", 31337001, SU),
    _m("purchases.purchase", "result_expires_at", _at(2), SU),
    _m("purchases.purchaseevent", "actor", "mark-event-actor", ALL),
    _m("purchases.purchaseevent", "evidence", {"mark": "mark-event-evidence"}, ALL),
    # Payment attempts: the money for both, evidence for support, the signed authorization
    # and the relayer's transaction for nobody but a superuser.
    _m("payments.paymentattempt", "payer", "0x" + "d2" * 20, ALL),
    _m("payments.paymentattempt", "amount", 222333444, ALL),
    _m("payments.paymentattempt", "tx_hash", "0x" + "d3" * 32, ALL),
    _m("payments.paymentattempt", "block_number", 777000001, ALL),
    _m("payments.paymentattempt", "settlement_reference", "mark-settlement-ref", ALL),
    _m("payments.paymentattempt", "reason_code", "mark_attempt_reason", ALL),
    _m("payments.paymentattempt", "authorization_nonce", "0x" + "d4" * 32, SU),
    _m("payments.paymentattempt", "fingerprint", "mark-attempt-fingerprint", SU),
    _m("payments.paymentattempt", "valid_before_at", _at(3), SU),
    _m("payments.paymentattempt", "next_check_at", _at(4), SU),
    _m("payments.paymentattempt", "unanswered_checks", 612345678, SU),
    _m("payments.paymentattempt", "resubmissions", 812345678, SU),
    _m(
        "payments.paymentattempt",
        "authorization",
        {"mark": "mark-signed-authorization"},
        ONLY_SUPERUSER,
    ),
    _m("payments.paymentattempt", "raw_transaction", "0xmarkrawtransaction", ONLY_SUPERUSER),
    _m("payments.paymentattempt", "relayer_nonce", 555000001, ONLY_SUPERUSER),
    # Fulfilment: support's evidence; the result body and lease tokens are nobody's.
    _m("fulfillment.executionattempt", "worker", "mark-worker", SU),
    _m("fulfillment.executionattempt", "job_ref", "mark-job-ref", SU),
    _m("fulfillment.executionattempt", "tries", 412345678, SU),
    _m("fulfillment.executionattempt", "lease_token", "markexeclease01", NOBODY),
    _m("fulfillment.result", "sha256", "e1" * 32, SU),
    _m("fulfillment.result", "content_type", "text/x-mark", SU),
    _m("fulfillment.result", "body", b"MARK-RESULT-BODY", NOBODY),
    _m("fulfillment.receipt", "payer", "0x" + "d5" * 20, SU),
    _m("fulfillment.receipt", "transaction", "0x" + "d6" * 32, SU),
    _m("fulfillment.receipt", "body_sha256", "e2" * 32, SU),
    # Refunds, the ledger and balances: both roles.
    _m("payments.refund", "payer", "0x" + "d7" * 20, ALL),
    _m("payments.refund", "amount", 333444555, ALL),
    _m("payments.refund", "amount_human", "333.444555 USDC", ALL),
    _m("payments.refund", "transaction", "0x" + "d8" * 32, ALL),
    _m("payments.refund", "paid_reference", "0x" + "d9" * 32, ALL),
    _m("payments.refund", "paid_by", "mark-paid-by", ALL),
    _m("payments.refund", "reason_code", "mark_refund_reason", ALL),
    # Who proposed a refund (support, on the case file), why, and who decided (finance).
    _m("payments.refund", "note", "mark-refund-note", ALL),
    _m("payments.refund", "proposed_by", "mark-proposed-by", ALL),
    _m("payments.refund", "decided_by", "mark-decided-by", ALL),
    _m("payments.ledgerentry", "reference", "mark-ledger-ref", ALL),
    _m("payments.ledgerentry", "memo", "mark-ledger-memo", ALL),
    _m("payments.ledgerentry", "amount", 444555666, ALL),
    _m("payments.ledgerbalance", "amount", 555666777, ALL),
    _m("payments.ledgerbalance", "amount_human", "555.666777 USDC", ALL),
    # Escalations, keys and job runs: support's.
    _m("purchases.escalation", "details", {"mark": "mark-escalation-details"}, SU),
    _m("purchases.escalation", "resolution", "mark-resolution", SU),
    _m("purchases.escalation", "reason_code", "mark_escalation_reason", SU),
    # The case file's assignment: support's.
    _m("purchases.escalation", "note", "mark-escalation-note", SU),
    _m("purchases.escalation", "assigned_by", "mark-assigned-by", SU),
    _m("purchases.escalation", "assignee", "mark-assignee", SU),
    _m("purchases.escalation", "resolution_code", "mark_resolution_code", SU),
    _m("purchases.idempotencyrecord", "key", "mark-idem-key", SU),
    _m("purchases.idempotencyrecord", "principal", "mark-principal", SU),
    _m("purchases.idempotencyrecord", "response_body", {"mark": "mark-response-body"}, SU),
    _m("purchases.idempotencyrecord", "lease_token", "markidemlease01", NOBODY),
    _m("purchases.jobrun", "job", "mark-job", SU),
    _m("purchases.jobrun", "error", "mark-jobrun-error", SU),
    # Payouts: finance works them, support reads them; the signed bytes are superusers'.
    _m("payments.payout", "destination", "0x" + "e5" * 20, ALL),
    _m("payments.payout", "tx_hash", "0x" + "e6" * 32, ALL),
    _m("payments.payout", "approved_by", "mark-payout-approver", ALL),
    _m("payments.payout", "second_approved_by", "mark-payout-second", ALL),
    _m("payments.payout", "raw_transaction", "0xmarkpayoutraw", ONLY_SUPERUSER),
    # Buyers' refund requests: support decides them, finance reads the queue.
    _m("purchases.refundrequest", "reason", "mark-refund-request-reason", ALL),
    _m("purchases.refundrequest", "requested_by", "mark-refund-requester", ALL),
    _m("purchases.refundrequest", "decision_note", "mark-refund-request-note", ALL),
    # Export batches: finance's books.
    _m("payments.exportbatch", "created_by", "mark-exporter", FU),
    _m("payments.exportbatch", "sha256", "e3" * 32, FU),
    _m("payments.exportbatch", "filters", {"mark": "mark-export-filters"}, FU),
    _m("payments.exportbatch", "row_count", 987654001, FU),
]
MARK = {(m.label, m.field): m for m in MARKS}


def _v(label: str, field: str) -> Any:
    return MARK[label, field].value


def _seed() -> dict[str, Model]:
    """One row per model, every marked field holding its mark."""
    offering = OfferingFactory.create(
        slug=_v("purchases.offering", "slug"),
        description=_v("purchases.offering", "description"),
    )
    buyer = Buyer.objects.create(name=_v("purchases.buyer", "name"))
    BuyerWallet.objects.create(buyer=buyer, address=_v("purchases.buyerwallet", "address"))
    ApiKey.objects.create(
        buyer=buyer,
        prefix=_v("purchases.apikey", "prefix"),
        label=_v("purchases.apikey", "label"),
        key_hash=_v("purchases.apikey", "key_hash"),
    )
    purchase = PurchaseFactory.create(
        quote__offering=offering,
        quote__buyer=buyer,
        quote__canonical_input=_v("purchases.quote", "canonical_input"),
        quote__input_hash=_v("purchases.quote", "input_hash"),
        quote__quote_key=_v("purchases.quote", "quote_key"),
        buyer=buyer,
        payer=_v("purchases.purchase", "payer"),
        amount=_v("purchases.purchase", "amount"),
        reason_code=_v("purchases.purchase", "reason_code"),
        paid_at=_v("purchases.purchase", "paid_at"),
    )
    PurchaseEvent.objects.create(
        purchase=purchase,
        subject="purchase.payment",
        # A person: every role reads who acted (a system actor's name is a worker's, shown
        # only with the workers: test_the_timeline_names_a_worker_only_to_...).
        actor_type="staff",
        actor=_v("purchases.purchaseevent", "actor"),
        evidence=_v("purchases.purchaseevent", "evidence"),
    )
    record = IdempotencyRecord.objects.create(
        scope="x402",
        purchase=purchase,
        created_at=timezone.now(),
        **{f: _v("purchases.idempotencyrecord", f) for f in ("key", "principal", "lease_token")},
        response_body=_v("purchases.idempotencyrecord", "response_body"),
    )
    attempt_fields = [m.field for m in MARKS if m.label == "payments.paymentattempt"]
    attempt = PaymentAttempt.objects.create(
        purchase=purchase,
        rail="x402",
        idempotency_record=record,
        network=purchase.network,
        asset=purchase.asset,
        state=PaymentAttempt.State.SUCCEEDED,
        **{f: _v("payments.paymentattempt", f) for f in attempt_fields},
    )
    execution = ExecutionAttempt.objects.create(
        purchase=purchase,
        executor="report",
        job_idempotency_key="job-key",
        lease_expires_at=timezone.now(),
        started_at=timezone.now(),
        **{
            f: _v("fulfillment.executionattempt", f)
            for f in ("worker", "job_ref", "tries", "lease_token")
        },
    )
    body = _v("fulfillment.result", "body")
    Result.objects.create(
        purchase=purchase,
        execution=execution,
        content_type=_v("fulfillment.result", "content_type"),
        body=body,
        sha256=_v("fulfillment.result", "sha256"),
        size=_v("purchases.purchase", "result_size"),
        created_at=timezone.now(),
        expires_at=_v("purchases.purchase", "result_expires_at"),
    )
    Receipt.objects.create(
        purchase=purchase,
        amount=purchase.amount,
        asset=purchase.asset,
        network=purchase.network,
        delivered_at=timezone.now(),
        **{f: _v("fulfillment.receipt", f) for f in ("payer", "transaction", "body_sha256")},
    )
    Refund.objects.create(
        purchase=purchase,
        payment_attempt=attempt,
        method=Refund.Method.PAY_BACK,
        asset=purchase.asset,
        network=purchase.network,
        state=Refund.State.PAID,
        paid_at=timezone.now(),
        **{
            f: _v("payments.refund", f)
            for f in (
                "payer",
                "amount",
                "transaction",
                "paid_reference",
                "paid_by",
                "reason_code",
                "note",
                "proposed_by",
                "decided_by",
            )
        },
    )
    Payout.objects.create(
        refund=Refund.objects.get(purchase=purchase),
        network=purchase.network,
        asset=purchase.asset,
        amount=1,
        approved_at=timezone.now(),
        cap_day=timezone.now().date(),
        **{
            f: _v("payments.payout", f)
            for f in (
                "destination",
                "tx_hash",
                "approved_by",
                "second_approved_by",
                "raw_transaction",
            )
        },
    )
    LedgerEntry.objects.create(
        buyer=buyer,
        asset=offering.asset,
        kind=LedgerEntry.Kind.TOP_UP,
        **{f: _v("payments.ledgerentry", f) for f in ("reference", "memo", "amount")},
    )
    LedgerBalance.objects.create(
        buyer=buyer, asset=offering.asset, amount=_v("payments.ledgerbalance", "amount")
    )
    Escalation.objects.create(
        purchase=purchase,
        owner="support",
        deadline_at=timezone.now(),
        **{
            f: _v("purchases.escalation", f)
            for f in (
                "details",
                "resolution",
                "reason_code",
                "note",
                "assigned_by",
                "assignee",
                "resolution_code",
            )
        },
    )
    RefundRequest.objects.create(
        purchase=purchase,
        channel=RefundRequest.Channel.API_KEY,
        amount=1,
        asset=purchase.asset,
        idempotency_key="mark-refund-request-key-01",
        request_fingerprint="f" * 64,
        deadline_at=timezone.now(),
        **{
            f: _v("purchases.refundrequest", f) for f in ("reason", "requested_by", "decision_note")
        },
    )
    JobRun.objects.create(
        job=_v("purchases.jobrun", "job"),
        error=_v("purchases.jobrun", "error"),
        started_at=timezone.now(),
    )
    ExportBatch.objects.create(
        kind="refunds",
        started_at=timezone.now(),
        **{
            f: _v("payments.exportbatch", f)
            for f in ("created_by", "sha256", "filters", "row_count")
        },
    )
    return {"purchase": purchase, "buyer": buyer}


# --- the world, once per module (the pages are read-only; each test rolls back its own) ----
@dataclass
class Seen:
    clients: dict[str, Client]
    purchase: Purchase
    buyer: Buyer
    pages: dict[tuple[str, str], Any]  # (role, url) -> response, fetched once


def _client(username: str, group: str | None) -> Client:
    user = User.objects.create_user(username=username, is_staff=True, is_superuser=not group)
    if group:
        user.groups.add(Group.objects.get(name=group))
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture(scope="module")
def seen(django_db_setup: None, django_db_blocker: Any) -> Iterator[Seen]:
    with django_db_blocker.unblock(), transaction.atomic():
        roles_ensure()
        rows = _seed()
        clients = {
            SUPPORT: _client("matrix-support", SUPPORT),
            FINANCE: _client("matrix-finance", FINANCE),
            SUPERUSER: _client("matrix-root", None),
        }
        yield Seen(clients, rows["purchase"], rows["buyer"], {})  # type: ignore[arg-type]
        transaction.set_rollback(True)


def _model(label: str) -> type[Model]:
    from django.apps import apps

    return apps.get_model(label)


INLINE_PARENT = {  # the page where an inline-only model is shown
    "purchases.purchaseevent": "purchase",
    "purchases.buyerwallet": "buyer",
    "purchases.apikey": "buyer",
}
# Models shown as inlines on the purchase page as well as on their own pages.
ON_PURCHASE_PAGE = {
    "purchases.purchaseevent",
    "payments.paymentattempt",
    "fulfillment.executionattempt",
    "payments.refund",
    "purchases.escalation",
}


def _urls(seen: Seen, label: str) -> dict[str, str]:
    """The pages on which a row of `label` shows: own change page, own list, parent page."""
    model = _model(label)
    urls: dict[str, str] = {}
    purchase_page = reverse("admin:purchases_purchase_change", args=[seen.purchase.pk])
    buyer_page = reverse("admin:purchases_buyer_change", args=[seen.buyer.pk])
    if model in admin.site._registry:
        obj = model._default_manager.order_by("-pk").first()
        assert obj is not None
        opts = model._meta
        urls["change"] = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk])
        urls["list"] = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
        if model is Refund:
            urls["list"] += "?state=all"
    if label in ON_PURCHASE_PAGE or INLINE_PARENT.get(label) == "purchase":
        urls["parent"] = purchase_page
    if INLINE_PARENT.get(label) == "buyer":
        urls["parent"] = buyer_page
    return urls


def _page(seen: Seen, role: str, url: str) -> tuple[int, str]:
    key = (role, url)
    if key not in seen.pages:
        response = seen.clients[role].get(url)
        seen.pages[key] = (response.status_code, response.content.decode())
    status, text = seen.pages[key]
    return status, text


# --- role x model x field: on the pages ----------------------------------------------------
@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("mark", MARKS, ids=lambda m: f"{m.label}.{m.field}")
def test_a_marked_field_shows_exactly_where_the_role_sees_it(
    seen: Seen, role: str, mark: Mark
) -> None:
    urls = _urls(seen, mark.label)
    assert urls, f"{mark.label} is shown nowhere"
    shown_to_superuser = []
    for kind, url in urls.items():
        status, text = _page(seen, role, url)
        _, superuser_text = _page(seen, SUPERUSER, url)
        superuser_has = mark.shown in superuser_text
        shown_to_superuser.append(superuser_has)
        if role in mark.seen_by:
            assert status == 200, f"{role} cannot open {kind} {url}"
            assert (mark.shown in text) == superuser_has, f"{kind} {url}"
        else:
            assert mark.shown not in text, f"{role} sees {mark.field} on {kind} {url}"
    if mark.seen_by:
        assert any(shown_to_superuser), f"the mark of {mark.field} is shown nowhere"


def _searchable(label: str, field: str) -> bool:
    model_admin = admin.site._registry.get(_model(label))
    paths = {p.lstrip("=^@") for p in getattr(model_admin, "search_fields", ())}
    return field in paths


SEARCHED = [m for m in MARKS if _model(m.label) in admin.site._registry]


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("mark", SEARCHED, ids=lambda m: f"{m.label}.{m.field}")
def test_search_by_a_field_finds_only_what_the_role_sees(seen: Seen, role: str, mark: Mark) -> None:
    model = _model(mark.label)
    list_url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
    params = {"q": mark.shown, **({"state": "all"} if model is Refund else {})}
    response = seen.clients[role].get(list_url, params)
    if response.status_code == 403:
        assert role not in mark.seen_by
        pytest.skip(f"{role} cannot open the list: there is no search to leak through")
    assert response.status_code == 200
    if not admin.site._registry[model].search_fields:
        assert 'id="searchbar"' not in response.content.decode()
        pytest.skip("the list has no search box: there is no search to leak through")
    found = response.context["cl"].result_count
    expected = role in mark.seen_by and _searchable(mark.label, mark.field)
    assert found == (1 if expected else 0), f"{role} searching {mark.field}"


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("mark", SEARCHED, ids=lambda m: f"{m.label}.{m.field}")
def test_a_hidden_field_cannot_be_a_filter_typed_into_the_url(
    seen: Seen, role: str, mark: Mark
) -> None:
    model = _model(mark.label)
    if not any(f.name == mark.field for f in model._meta.fields):
        return  # a display name, not a column: nothing to filter by
    if isinstance(mark.value, (dict, bytes)):
        return  # JSON and bytes are not URL lookups
    list_url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
    response = seen.clients[role].get(list_url, {mark.field: str(mark.value)})
    if role in mark.seen_by:
        assert response.status_code == 200
    else:
        # Refused as a disallowed lookup (400), or the model is not the role's at all (403).
        assert response.status_code in (400, 403), response.status_code


# --- the declarative table, walked: every name it gives a role is real, and on its pages ----
def _table_cases() -> list[tuple[str, str, str]]:
    cases = []
    for role, models in ROLE_TABLE.items():
        for label, scope in models.items():
            cases += [(role, label, name) for name in sorted(scope.fields)]
    return cases


def _owners(model: type[Model]) -> list[Any]:
    """The ModelAdmin and the inline classes that show this model."""
    owners: list[Any] = [admin.site._registry[model]] if model in admin.site._registry else []
    for model_admin in admin.site._registry.values():
        owners += [inline for inline in model_admin.inlines if inline.model is model]
    return owners


def _admin_names(label: str) -> set[str]:
    """Every name the admins could show, filter or search for this model (unscoped)."""
    model = _model(label)
    names = {f.name for f in model._meta.get_fields()} | {"pk"}
    for owner in _owners(model):
        names |= {n for n in getattr(owner, "list_display", ()) if isinstance(n, str)}
        names |= set(getattr(owner, "readonly_fields", ()) or ())
        names |= set(getattr(owner, "fields", ()) or ())
        names |= {p.lstrip("=^@") for p in getattr(owner, "search_fields", ())}
        # A list filter of its own is named by its URL parameter (the purchase queues).
        names |= {f.parameter_name for f in getattr(owner, "list_filter", ()) if _is_class(f)}
    if model is Purchase:
        names |= CASE_EVIDENCE_NAMES
    return names


def _is_class(entry: Any) -> bool:
    return isinstance(entry, type) and hasattr(entry, "parameter_name")


def _structure(text: str) -> set[str]:
    """The field rows (change page) and columns (list) a page has, by their CSS class."""
    return set(re.findall(r'class="[^"]*\b(?:field|column)-([a-z_0-9]+)', text))


@pytest.mark.parametrize(("role", "label", "name"), _table_cases())
def test_every_name_in_the_table_is_a_real_field_or_column(
    role: str, label: str, name: str
) -> None:
    assert name in _admin_names(label), f"{role}: {label} has no field or column {name!r}"
    assert name not in NEVER_SHOWN.get(label, ()), f"{role} is given key material {name}"


@pytest.mark.parametrize("mark", MARKS, ids=lambda m: f"{m.label}.{m.field}")
def test_the_table_agrees_with_the_expectations(mark: Mark) -> None:
    for role in (SUPPORT, FINANCE):
        scope = ROLE_TABLE[role].get(mark.label)
        in_table = scope is not None and mark.field in scope.fields
        assert in_table == (role in mark.seen_by), f"{role} / {mark.label}.{mark.field}"
    never = mark.field in NEVER_SHOWN.get(mark.label, ())
    assert never == (not mark.seen_by), f"key material {mark.label}.{mark.field}"


@pytest.mark.django_db
@pytest.mark.parametrize(("role", "label", "name"), _table_cases())
def test_a_field_the_table_gives_is_on_the_page_where_a_superuser_has_it(
    seen: Seen, role: str, label: str, name: str
) -> None:
    for kind, url in _urls(seen, label).items():
        if kind == "parent":
            continue  # the parent page's rows mix models; the marks cover it
        status, text = _page(seen, role, url)
        assert status == 200, f"{role} cannot open the {kind} of {label}"
        _, superuser_text = _page(seen, SUPERUSER, url)
        if name in _structure(superuser_text):
            assert name in _structure(text), f"{role} lacks {name} on the {kind} of {label}"


TABLE_MODELS = sorted({(role, label) for role, label, _ in _table_cases()})


@pytest.mark.django_db
@pytest.mark.parametrize(("role", "label"), TABLE_MODELS)
def test_a_field_the_table_hides_has_no_row_or_column(seen: Seen, role: str, label: str) -> None:
    hidden = _admin_names(label) - ROLE_TABLE[role][label].fields - {"pk"}
    for kind, url in _urls(seen, label).items():
        if kind == "parent":
            continue
        status, text = _page(seen, role, url)
        assert status == 200
        shown = _structure(text) & hidden
        assert not shown, f"{role}: the {kind} of {label} shows {shown}"


@pytest.mark.django_db
def test_key_material_has_no_row_or_column_even_for_a_superuser(seen: Seen) -> None:
    for label, names in NEVER_SHOWN.items():
        for url in _urls(seen, label).values():
            status, text = _page(seen, SUPERUSER, url)
            assert status == 200
            assert not _structure(text) & names, (label, url)


# --- role x action ------------------------------------------------------------------------
@dataclass(frozen=True)
class Action:
    model: type[Model]
    name: str
    allowed: frozenset[str]


ACTIONS = [
    Action(Refund, "mark_paid_back", FU),
    Action(Refund, "export_csv", FU),
    Action(Escalation, "resolve_selected", SU),
    Action(Escalation, "assign_to_me", SU),
    Action(RefundRequest, "assign_to_me", SU),
    Action(Buyer, "issue_api_key", ONLY_SUPERUSER),
    Action(Buyer, "delete_selected", ONLY_SUPERUSER),
    Action(Offering, "delete_selected", ONLY_SUPERUSER),
]


def _list_url(model: type[Model]) -> str:
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("action", ACTIONS, ids=lambda a: f"{a.model.__name__}.{a.name}")
def test_an_action_is_offered_and_runs_only_for_its_roles(
    seen: Seen, role: str, action: Action
) -> None:
    client = seen.clients[role]
    listing = client.get(_list_url(action.model) + ("?state=all" if action.model is Refund else ""))
    offered = listing.status_code == 200 and f'value="{action.name}"' in listing.content.decode()
    assert offered == (role in action.allowed)
    obj = action.model._default_manager.order_by("pk").first()
    assert obj is not None
    posted = client.post(
        _list_url(action.model), {"action": action.name, "_selected_action": [obj.pk], "index": 0}
    )
    if role in action.allowed:
        # The action's page, its file, or "nothing to do" back to the list.
        assert posted.status_code in (200, 302)
    else:
        assert posted.status_code == 403


PAGES = [  # actions that are pages of their own
    ("admin:payments_ledgerentry_top_up", None, FU),
    ("admin:payments_exportbatch_books", None, FU),
    ("admin:purchases_escalation_resolve", Escalation, SU),
    ("admin:purchases_refundrequest_decide", RefundRequest, SU),
]


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize(("name", "model", "allowed"), PAGES, ids=[p[0] for p in PAGES])
def test_an_action_page_opens_only_for_its_roles(
    seen: Seen, role: str, name: str, model: type[Model] | None, allowed: frozenset[str]
) -> None:
    args = [model._default_manager.order_by("pk").first().pk] if model else []  # type: ignore[union-attr]
    url = reverse(name, args=args)
    client = seen.clients[role]
    assert client.get(url).status_code == (200 if role in allowed else 403)
    if role not in allowed:
        assert client.post(url, {"apply": "1", "resolution": "x"}).status_code == 403


def test_every_admin_and_inline_is_role_scoped() -> None:
    for model_admin in admin.site._registry.values():
        if model_admin.opts.app_label not in ("purchases", "payments", "fulfillment"):
            continue
        assert isinstance(model_admin, RoleScopedAdmin), type(model_admin)
        for inline in model_admin.inlines:
            assert issubclass(inline, RoleScopedAdmin), inline


@pytest.mark.django_db
def test_a_staff_member_without_a_role_sees_nothing(seen: Seen) -> None:
    client = Client()
    client.force_login(User.objects.create_user(username="matrix-nobody", is_staff=True))
    for label in itertools.chain.from_iterable(ROLE_TABLE.values()):
        for url in _urls(seen, label).values():
            assert client.get(url).status_code == 403, url


# --- the purchase case file: its evidence and its staff actions by role ---------------------
# Independent of the table: which of the case file's evidence each role reads on the
# purchase page (by the label of its line in the lifecycle strip).
CASE_STRIP = [
    ("terms version", ALL),  # the quote
    ("window closes", SU),  # the authorization
    ("payer", SU),  # the authorization's payer (finance reads it on the attempt row)
    ("job ref", SU),  # the execution
    ("result SHA-256", SU),  # the result's digest
    ("receipt", ALL),
    ("amount", ALL),  # the settlement's money
    ("paid at", ALL),
    ("owner", SU),  # an escalation
]


def _strip(text: str) -> str:
    match = re.search(r'<section class="case-strip".*?</section>', text, flags=re.S)
    assert match, "no lifecycle strip"
    return match.group(0)


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize(("label", "seen_by"), CASE_STRIP, ids=[c[0] for c in CASE_STRIP])
def test_the_case_strip_shows_evidence_only_to_its_roles(
    seen: Seen, role: str, label: str, seen_by: frozenset[str]
) -> None:
    url = reverse("admin:purchases_purchase_change", args=[seen.purchase.pk])
    status, text = _page(seen, role, url)
    assert status == 200
    assert (f"<dt>{label}</dt>" in _strip(text)) == (role in seen_by), label


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
def test_the_now_box_names_an_escalation_reason_only_to_support(seen: Seen, role: str) -> None:
    url = reverse("admin:purchases_purchase_change", args=[seen.purchase.pk])
    _, text = _page(seen, role, url)
    notes = re.findall(r'data-testid="case-note">([^<]*)<', text)
    reason = _v("purchases.escalation", "reason_code")
    expected = f"Escalated to support: {reason}." if role in SU else "Escalated to support."
    assert expected in notes, notes


# Independent of the table: the case file's staff actions, and whose they are.
CASE_ACTIONS = {
    "recheck_settlement": SU,
    "reconcile_execution": SU,
    "redeliver_result": SU,
    "assign": SU,
    "propose_refund": SU,
    "resolve": SU,
    "approve_refund": FU,  # approve or decline what support proposed
}


@pytest.mark.parametrize("name", sorted(CASE_ACTIONS))
def test_the_table_agrees_with_the_case_action_expectations(name: str) -> None:
    for role in (SUPPORT, FINANCE):
        granted = name in ROLE_TABLE[role]["purchases.purchase"].actions
        assert granted == (role in CASE_ACTIONS[name]), f"{role} / {name}"


def _case_for(cases: Cases, name: str) -> Purchase:
    """A purchase whose case makes `name` safe now (checked through a superuser's page)."""
    if name == "approve_refund":
        case_refund_propose(
            purchase_id=cases.done.pk, staff="sam-support", kind="refund", note="matrix"
        )
        return cases.done
    return {
        "recheck_settlement": cases.pending,
        "reconcile_execution": cases.stalled,
        "redeliver_result": cases.done,
        "propose_refund": cases.done,
    }.get(name, cases.unknown)


FORM_ACTIONS = {"assign", "propose_refund", "resolve", "approve_refund"}


def _offered(page: str) -> set[str]:
    return set(re.findall(r'data-testid="case-action-(\w+)"', page))


@pytest.mark.django_db
@pytest.mark.parametrize("name", sorted(CASE_ACTIONS))
def test_a_case_action_is_offered_and_opens_only_for_its_roles(
    cases: Cases,
    support: Client,
    finance: Client,
    superuser: Client,
    name: str,
) -> None:
    purchase = _case_for(cases, name)
    page_url = reverse("admin:purchases_purchase_change", args=[purchase.pk])
    action_url = reverse("admin:purchases_purchase_case_action", args=[purchase.pk, name])
    assert name in _offered(superuser.get(page_url).content.decode())  # the case makes it safe
    events = purchase.events.count()
    for role, client in ((SUPPORT, support), (FINANCE, finance)):
        allowed = role in CASE_ACTIONS[name]
        assert (name in _offered(client.get(page_url).content.decode())) == allowed, role
        # The form (or, for a one-click action, back to the page) only for its roles; the
        # table is checked before the case, so a forged POST by another role moves nothing.
        status = client.get(action_url).status_code
        if allowed:
            assert status == (200 if name in FORM_ACTIONS else 302), role
        else:
            assert status == 403, role
            assert client.post(action_url, {"note": "forged"}).status_code == 403, role
    assert purchase.events.count() == events


# Independent of the table: which evidence on the timeline each role reads (docs/admin.md's
# role table). The relayer's nonce and the signature are nobody's; the authorization's nonce
# and window, job refs and the result's digest are support's; money and chain refs are both's.
CASE_TIMELINE = [
    ("relayer_nonce", 987_654_321, ONLY_SUPERUSER),
    ("nonce", "0x" + "e1" * 32, SU),
    ("signature", "0x" + "e4" * 65, ONLY_SUPERUSER),
    ("job_ref", "mark-timeline-job-ref", SU),
    ("sha256", "e5" * 32, SU),
    ("body_sha256", "e6" * 32, SU),
    ("fingerprint", "e7" * 32, SU),
    ("url", "/x402/purchases/mark-timeline-capability", SU),
    ("tx_hash", "0x" + "e2" * 32, ALL),
    ("payer", "0x" + "e8" * 20, ALL),
]
# The same, nested in a facilitator's answer (a list of answers, each a dict).
CASE_TIMELINE_NESTED = [("nonce", "0x" + "e3" * 32, SU), ("transaction", "0x" + "e9" * 32, ALL)]
# A relayer nonce gap closed before a broadcast (payments.rails.x402.direct): the relayer's nonce
# stays the superuser's, the transaction sent is everyone's.
CASE_TIMELINE_GAP = [
    ("relayer_nonce", 876_543_219, ONLY_SUPERUSER),
    ("tx_hash", "0x" + "ea" * 32, ALL),
]


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
def test_the_timeline_shows_evidence_only_to_its_roles(seen: Seen, role: str) -> None:
    answers = [{"payload": {"authorization": {k: v for k, v, _ in CASE_TIMELINE_NESTED}}}]
    PurchaseEvent.objects.create(
        purchase=seen.purchase,
        subject="payment.broadcast",
        actor_type="system",
        evidence={
            **{k: v for k, v, _ in CASE_TIMELINE},
            "answers": answers,
            "relayer_gap_closed": [{k: v for k, v, _ in CASE_TIMELINE_GAP}],
        },
    )
    url = reverse("admin:purchases_purchase_change", args=[seen.purchase.pk])
    response = seen.clients[role].get(url)  # not the cached page: the event is this test's
    match = re.search(r'id="case-timeline".*?</table>', response.content.decode(), flags=re.S)
    assert match, "no timeline"
    for key, value, seen_by in CASE_TIMELINE + CASE_TIMELINE_NESTED + CASE_TIMELINE_GAP:
        assert (str(value) in match.group(0)) == (role in seen_by), (role, key)


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
def test_the_timeline_names_a_worker_only_to_the_roles_that_see_workers(
    seen: Seen, role: str
) -> None:
    """A system actor's name is a worker or a host: finance reads "system" (issue 33: the
    docs said finance never sees workers, the timeline's actor column showed them)."""
    worker = "celery@mark-worker-host-7"
    PurchaseEvent.objects.create(
        purchase=seen.purchase,
        subject="execution_attempt",
        actor_type="system",
        actor=worker,
        from_state="running",
        to_state="succeeded",
    )
    url = reverse("admin:purchases_purchase_change", args=[seen.purchase.pk])
    page = seen.clients[role].get(url).content.decode()
    match = re.search(r'id="case-timeline".*?</table>', page, flags=re.S)
    assert match, "no timeline"
    assert (worker in match.group(0)) == (role in SU), role
