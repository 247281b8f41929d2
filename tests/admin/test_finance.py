"""Finance's back office: export batches, pay-back references per rail, prepaid balances."""

from __future__ import annotations

import hashlib

import pytest
from django.contrib import admin
from django.contrib.auth.models import User
from django.core.signals import request_finished
from django.db import close_old_connections, connection
from django.test import Client, RequestFactory
from django.urls import reverse
from django.utils import timezone

from backoffice.admin.finance import ledger_reference_of_refunds, refund_csv_response
from backoffice.admin.payments import RefundAdmin
from backoffice.roles import roles_ensure
from core.admin import RoleScoping, amount_human
from core.exports import StreamSummary, csv_stream
from payments.models import ExportBatch, LedgerBalance, LedgerEntry, Refund
from payments.services import RefundReferenceInvalid, ledger_credit, refund_mark_paid
from tests.admin.test_admin import TX_HASH, World, _action, _change, _changelist
from tests.factories import USDC_LOCAL

pytestmark = pytest.mark.django_db


def _export(client: Client, refunds: list[Refund], **extra: str) -> bytes:
    response = client.post(
        _changelist(Refund) + "?state=all",
        {"action": "export_csv", "_selected_action": [r.pk for r in refunds], "index": 0, **extra},
    )
    assert response.status_code == 200
    return b"".join(response.streaming_content)  # type: ignore[attr-defined]


# --- every export is a batch --------------------------------------------------------------
def test_an_export_is_recorded_with_its_files_sha256_and_rows(
    world: World, finance: Client
) -> None:
    owed, paid = world.owed, world.paid
    body = _export(finance, [owed, paid])
    batch = ExportBatch.objects.get()
    assert batch.sha256 == hashlib.sha256(body).hexdigest()
    assert batch.row_count == 2 == body.count(b"\r\n") - 1  # the header is not a row
    assert (batch.kind, batch.created_by) == ("refunds", "fay-finance")
    assert batch.filters == {"query": {"state": ["all"]}, "selection": "2 ticked"}
    assert (batch.first_created_at, batch.last_created_at) == (owed.created_at, paid.created_at)
    assert batch.started_at <= batch.created_at

    # "Select all" over the filtered list (Django still wants one box ticked).
    again = _export(finance, [owed], select_across="1")
    assert again == body
    second = ExportBatch.objects.order_by("pk").last()
    assert second is not None and second.pk != batch.pk
    assert (second.sha256, second.row_count) == (batch.sha256, 2)  # the re-export compares
    assert second.filters["selection"] == "all matching"

    page = finance.get(_changelist(ExportBatch)).content.decode()
    assert page.count(batch.sha256) == 2
    assert finance.get(_change(batch)).status_code == 200
    assert finance.post(_change(batch), {"row_count": "1"}).status_code == 403  # read-only


def test_an_abandoned_download_records_no_batch(world: World) -> None:
    finance_user = User.objects.create_user(username="fin-2", is_staff=True)
    finance_user.groups.add(roles_ensure()["finance"])
    request = RequestFactory().post(_changelist(Refund), {"_selected_action": [world.owed.pk]})
    request.user = finance_user
    refunds = admin.site._registry[Refund]
    assert isinstance(refunds, RefundAdmin)
    response = refunds.export_csv(request, Refund.objects.all())
    chunks = iter(response.streaming_content)  # type: ignore[arg-type]  # sync here
    assert next(chunks).startswith(b"purchase,method,")
    # What a WSGI server does when the client goes away: close the response mid-stream.
    # (request_finished would close the test's own database connection: held off here.)
    request_finished.disconnect(close_old_connections)
    try:
        response.close()
    finally:
        request_finished.connect(close_old_connections)
    assert not ExportBatch.objects.exists()
    assert list(chunks) == []  # closed: nothing more is produced, nothing recorded


def test_a_stream_reports_rows_and_digest_only_when_it_ends() -> None:
    summaries: list[StreamSummary] = []
    at = timezone.now()
    rows = [((str(n), "x,y"), at) for n in range(1200)]  # three chunks of 500 rows at most
    stream = csv_stream(("n", "text"), iter(rows), summaries.append)
    first = next(stream)
    stream.close()
    assert summaries == []
    body = b"".join(csv_stream(("n", "text"), iter(rows), summaries.append))
    assert body.startswith(first) and body.count(b"\r\n") == 1201
    assert b'0,"x,y"\r\n' in body  # quoted like any csv.writer row
    assert summaries == [StreamSummary(1200, hashlib.sha256(body).hexdigest(), at, at)]


def test_support_neither_exports_nor_sees_the_batches(world: World, support: Client) -> None:
    response = _action(support, Refund, "export_csv", [world.owed.pk], index="0")
    assert response.status_code == 403
    assert not ExportBatch.objects.exists()
    assert support.get(_changelist(ExportBatch)).status_code == 403


# --- prepaid credits on the refund list ----------------------------------------------------
def test_the_refund_list_names_the_ledger_credit_of_a_prepaid_refund(
    world: World, finance: Client
) -> None:
    page = finance.get(_changelist(Refund), {"state": "all"}).content.decode()
    credit = LedgerEntry.objects.get(reference=f"refund:{world.paid.pk}")
    assert f'<td class="field-ledger_reference">{credit.reference}</td>' in page
    assert '<td class="field-ledger_reference">-</td>' in page  # the chain refund has none
    detail = finance.get(_change(world.paid)).content.decode()
    assert credit.reference in detail and "USDC" in detail


# --- pay-back references, per rail ---------------------------------------------------------
def test_a_chain_refund_is_closed_only_by_a_transaction_hash(world: World, finance: Client) -> None:
    refund = world.owed
    field = f"reference_{refund.pk}"
    for wrong in ("bank-77", "0xdead", "0x" + "9d" * 31, "0x" + "zz" * 32, "9d" * 32 + "00"):
        response = _action(
            finance, Refund, "mark_paid_back", [refund.pk], apply="1", **{field: wrong}
        )
        assert response.status_code == 200
        assert "transaction hash (0x + 64 hex)" in response.content.decode()
    refund.refresh_from_db()
    assert (refund.state, refund.paid_reference) == ("owed", "")
    with pytest.raises(RefundReferenceInvalid):
        refund_mark_paid(refund_id=refund.pk, reference="bank-77", by="x", now=timezone.now())


def _owed_prepaid_refund(world: World, reason: str) -> Refund:
    # Prepaid refunds are credited at once by the service; an owed one is finance's by hand.
    return Refund.objects.create(
        purchase=world.prepaid,
        payment_attempt=world.prepaid.payment_attempts.get(),
        method=Refund.Method.LEDGER_CREDIT,
        amount=250_000,
        asset=world.prepaid.asset,
        network="prepaid",
        payer=world.prepaid.buyer.ref,  # type: ignore[union-attr]
        reason_code=reason,
    )


def test_a_prepaid_refund_is_closed_only_by_its_own_ledger_credit(
    world: World, finance: Client
) -> None:
    buyer = world.prepaid.buyer
    assert buyer is not None
    refund = _owed_prepaid_refund(world, "manual_goodwill")
    field = f"reference_{refund.pk}"

    def mark(reference: str) -> str:
        answer = _action(
            finance, Refund, "mark_paid_back", [refund.pk], apply="1", **{field: reference}
        )
        return answer.content.decode() if answer.status_code == 200 else ""

    def credit(amount: int, reference: str) -> None:
        ledger_credit(
            buyer_id=buyer.pk,
            asset=refund.asset,
            kind=LedgerEntry.Kind.TOP_UP,
            amount=amount,
            reference=reference,
        )

    credit(100, "top_up:too-small")
    assert "No ledger credit with this reference" in mark("0x" + "9d" * 32)
    assert "That ledger credit is 100, the refund 250000" in mark("top_up:too-small")
    # The automatic credit of another refund already closes that refund.
    assert "already closes another refund" in mark(f"refund:{world.paid.pk}")
    refund.refresh_from_db()
    assert refund.state == "owed"

    credit(250_000, "top_up:goodwill-1")
    assert mark("top_up:goodwill-1") == ""  # accepted: redirected back to the list
    refund.refresh_from_db()
    assert (refund.state, refund.paid_reference) == ("paid", "top_up:goodwill-1")
    other = _owed_prepaid_refund(world, "second_goodwill")
    with pytest.raises(RefundReferenceInvalid, match="already closes another refund"):
        refund_mark_paid(
            refund_id=other.pk, reference="top_up:goodwill-1", by="x", now=timezone.now()
        )


# --- balances ---------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["finance", "support"])
def test_each_buyers_prepaid_balance_is_listed_in_asset_units(
    world: World, role: str, request: pytest.FixtureRequest
) -> None:
    client: Client = request.getfixturevalue(role)
    buyer = world.prepaid.buyer
    assert buyer is not None
    balance = LedgerBalance.objects.get(buyer=buyer)
    url = reverse("admin:payments_ledgerbalance_changelist")
    page = client.get(url, {"q": buyer.ref}).content.decode()
    assert f"{amount_human(balance.amount, 6)} USDC" in page
    assert str(balance.amount) in page
    assert client.get(url, {"q": "buy_nobody"}).context["cl"].result_count == 0


@pytest.mark.postgres
def test_the_refund_csv_order_comes_from_an_index_not_a_sort(world: World) -> None:
    # The export reads in (created_at, id) order through a cursor: served by an index, its
    # first row streams at once; sorted, only after every refund was read (7.5 s at 1M).
    ordered = ledger_reference_of_refunds(Refund.objects.all()).order_by("created_at", "pk")
    sql, params = ordered.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_sort = off")  # what a cursor's fast start prefers
        cursor.execute(f"EXPLAIN {sql}", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "refund_export_order" in plan and "Sort" not in plan, plan


def test_a_role_that_does_not_see_a_field_gets_the_refund_csv_without_its_column(
    world: World,
) -> None:
    # One column list gives the header, the role filter and the values: a hidden field
    # drops its header and its value together, every other byte as before.
    user = User.objects.create_user(username="fin-3", is_staff=True)
    user.groups.add(roles_ensure()["finance"])
    request = RequestFactory().post(_changelist(Refund), {"_selected_action": [world.owed.pk]})
    request.user = user
    scoping = RoleScoping(request, Refund)
    scoping.fields -= {"amount_human", "ledger_reference", "payer"}
    owed = Refund.objects.get(pk=world.owed.pk)

    response = refund_csv_response(request, Refund.objects.filter(pk=owed.pk), scoping=scoping)
    body = b"".join(response.streaming_content)  # type: ignore[arg-type]  # sync here

    expected = (
        "purchase,method,amount_atomic,asset_symbol,asset,network,transaction,reason,state,"
        "created_at,paid_reference,paid_at\r\n"
        f"{world.x402.ref},pay_back,250000,USDC,{USDC_LOCAL},eip155:31337,{TX_HASH},"
        f"late_confirmation,owed,{owed.created_at.isoformat()},,\r\n"
    )
    assert body == expected.encode()
