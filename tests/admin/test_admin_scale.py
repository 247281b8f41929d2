"""The purchase admin stays cheap whatever the table holds: a bounded number of queries
through the real views, and searches that PostgreSQL answers from an index."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.urls import reverse

from payments.models import PaymentAttempt
from purchases.models import IdempotencyRecord, Purchase
from purchases.selectors import purchase_search_ids
from tests.factories import PaymentAttemptFactory, PurchaseFactory

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]
MAX_QUERIES = 10
# The purchase page with the support case file (Now box, strip, labelled timeline, inlines):
# session, user, role, the purchase with its joins, one query per table it shows and a
# buyer's balance (purchases.selectors.purchase_case_records), none per row.
PURCHASE_PAGE_MAX_QUERIES = 10
WALLET = "0x" + "ab" * 20
TX_HASH = "0x" + "5d" * 32
PAYMENT_ID = "pay-scale-0001-Case"


@pytest.fixture
def staff() -> Client:
    user = User.objects.create_user(username="sam", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def purchases() -> list[Purchase]:
    rows = [PurchaseFactory.create(payer=f"0x{i:040x}") for i in range(30)]
    target = PurchaseFactory.create(payer=WALLET.upper().replace("0X", "0x"))
    PaymentAttemptFactory.create(
        purchase=target, payment_id=PAYMENT_ID, payer=WALLET, tx_hash=TX_HASH, succeeded=True
    )
    return [*rows, target]


def _list_url() -> str:
    return reverse("admin:purchases_purchase_changelist")


def test_list_is_a_bounded_number_of_queries(staff, purchases, django_assert_max_num_queries):
    with django_assert_max_num_queries(MAX_QUERIES):
        response = staff.get(_list_url())
    assert response.status_code == 200
    assert purchases[0].ref in response.content.decode()


@pytest.mark.parametrize(
    "term",
    ["ref", "payment_id", "tx_hash", "tx_hash_upper", "payer", "payer_checksummed"],
)
def test_each_search_kind_finds_the_purchase_in_bounded_queries(
    staff, purchases, django_assert_max_num_queries, term
):
    target = purchases[-1]
    terms = {
        "ref": target.ref,
        "payment_id": PAYMENT_ID,
        "tx_hash": TX_HASH,
        "tx_hash_upper": TX_HASH.upper(),
        "payer": WALLET,
        "payer_checksummed": "0x" + WALLET[2:].upper(),
    }
    with django_assert_max_num_queries(MAX_QUERIES):
        response = staff.get(_list_url(), {"q": f"  {terms[term]} "})
    page = response.content.decode()
    assert response.status_code == 200
    assert target.ref in page
    assert purchases[0].ref not in page


def test_refs_and_payment_ids_stay_case_sensitive(purchases):
    target = purchases[-1]
    assert purchase_search_ids(term=target.ref) == [target.pk]
    assert purchase_search_ids(term=PAYMENT_ID.lower()) == []
    assert purchase_search_ids(term="") == []


def test_a_compacted_payment_id_is_still_found(purchases):
    from core.refs import payment_id_hash

    target = purchases[-1]
    IdempotencyRecord.objects.filter(key=PAYMENT_ID).update(key=payment_id_hash(PAYMENT_ID))
    assert purchase_search_ids(term=PAYMENT_ID) == [target.pk]


def test_purchase_page_is_a_bounded_number_of_queries(
    staff, purchases, django_assert_max_num_queries
):
    target = purchases[-1]
    url = reverse("admin:purchases_purchase_change", args=[target.pk])
    staff.get(url)  # warms the process's ContentType cache, as any running server has it
    with django_assert_max_num_queries(PURCHASE_PAGE_MAX_QUERIES):
        response = staff.get(url)
    assert response.status_code == 200
    assert TX_HASH in response.content.decode()


def _plan(sql: str, params: list[Any]) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a tiny table would be scanned anyway
        cursor.execute(f"EXPLAIN {sql}", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("SET LOCAL enable_seqscan = on")
    return plan


@pytest.mark.parametrize(
    ("queryset", "index"),
    [
        (lambda: Purchase.objects.filter(ref="pur_x"), "purchases_purchase_ref"),
        (lambda: PaymentAttempt.objects.filter(tx_hash=TX_HASH), "attempt_tx_hash_scale"),
        (
            lambda: IdempotencyRecord.objects.filter(key=PAYMENT_ID),
            "idempotency_key_scale",
        ),
    ],
    ids=["ref", "tx_hash", "payment_id"],
)
def test_exact_lookups_use_an_index(purchases, queryset, index):
    sql, params = queryset().query.sql_with_params()
    plan = _plan(sql, list(params))
    assert "Seq Scan" not in plan and index in plan, plan


def test_payer_search_uses_the_lower_case_index(purchases):
    from django.db.models.functions import Lower

    query = Purchase.objects.alias(p=Lower("payer")).filter(p=WALLET).values("pk").query
    sql, params = query.sql_with_params()
    plan = _plan(sql, list(params))
    assert "purchase_payer_lower_scale" in plan, plan


def test_the_whole_search_reads_no_table_sequentially(purchases):
    """Every arm of the UNION an index look-up: nothing grows with the table."""
    captured: list[str] = []
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        purchase_search_ids(term=TX_HASH)
    captured = [q["sql"] for q in queries.captured_queries]
    assert len(captured) == 1
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(f"EXPLAIN {captured[0]}")
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "Seq Scan" not in plan, plan
