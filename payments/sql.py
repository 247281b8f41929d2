"""Every statement the payments app writes by hand, each beside its SQLite twin.

The ORM first (docs/architecture.md, "Where the SQL lives"); what is here the ORM cannot
say in one statement. Table and column names come from the models' `_meta`; a statement
with a PostgreSQL-only form has its SQLite twin (the embedded default) in the same
function, and tests/test_sql_twins.py runs both on the same rows and compares what they
write. Services call these by what they do and never branch on the database themselves.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from typing import Any

from django.db import connection
from django.db.models import F

from core.bulk import insert_returning_pk
from core.sql import column, on_postgresql, table
from payments.models import LedgerBalance, LedgerEntry, PaymentAttempt, RelayerAccount

# -- the prepaid ledger ---------------------------------------------------------------------

_DEBIT_SQL = """
WITH debited AS (
    UPDATE {balances} SET {amount} = {amount} - %(amount)s
    WHERE {buyer} = %(buyer)s AND {asset} = %(asset)s AND {amount} >= %(amount)s
    RETURNING 1
)
INSERT INTO {entries} ({columns})
SELECT %(buyer)s, %(asset)s, -%(amount)s, %(kind)s, %(reference)s, %(purchase)s, '', %(now)s
FROM debited
RETURNING {entry_pk}
"""
# The debit entry's columns, in _DEBIT_SQL's SELECT order.
_DEBIT_FIELDS = ("buyer", "asset", "amount", "kind", "reference", "purchase", "memo", "created_at")


@functools.cache  # its text written once per database vendor
def _debit_sql(vendor: str) -> str:
    return _DEBIT_SQL.format(
        balances=table(LedgerBalance),
        amount=column(LedgerBalance, "amount"),
        buyer=column(LedgerBalance, "buyer"),
        asset=column(LedgerBalance, "asset"),
        entries=table(LedgerEntry),
        columns=", ".join(column(LedgerEntry, name) for name in _DEBIT_FIELDS),
        entry_pk=column(LedgerEntry, "id"),
    )


def ledger_debit_post(*, entry: LedgerEntry, amount: int) -> bool:
    """Take `amount` off the entry's buyer's running balance and post `entry` (a new debit
    of -amount), or neither when the balance is short: whether it posted (`entry` is then
    the saved row). One statement on PostgreSQL; the twin's balance UPDATE still decides."""
    if not on_postgresql():
        debited = LedgerBalance.objects.filter(
            buyer_id=entry.buyer_id, asset=entry.asset, amount__gte=amount
        ).update(amount=F("amount") - amount)
        if not debited:
            return False
        entry.save(force_insert=True)
        return True
    sql = _debit_sql(connection.vendor)
    params: dict[str, Any] = {
        "amount": amount,
        "buyer": entry.buyer_id,
        "asset": entry.asset,
        "kind": entry.kind,
        "reference": entry.reference,
        "purchase": entry.purchase_id,
        "now": entry.created_at,
    }
    return insert_returning_pk(entry, sql, params)


# -- x402 attempts ----------------------------------------------------------------------------


_SIGNED_FIELDS = ("tx_hash", "raw_transaction", "relayer_nonce", "relayer_address")


def attempt_mark_prepared(
    *, attempt_id: int, now: datetime, signed: tuple[str, str, int | None, str] | None
) -> None:
    """Stamp the attempt's first broadcast (kept if there is one) and, `signed` being the
    transaction's (tx hash, raw transaction, relayer nonce, relayer address), record it
    unless one is: one
    UPDATE, its text written once per shape (every broadcast runs it)."""
    values: list[tuple[str, Any]] = [("broadcast_started_at", now), ("updated_at", now)]
    if signed is not None:
        values += list(zip(_SIGNED_FIELDS, signed, strict=True))
    meta = PaymentAttempt._meta
    params = [meta.get_field(name).get_db_prep_save(value, connection) for name, value in values]  # type: ignore[union-attr]
    params.append(attempt_id)
    with connection.cursor() as cursor:
        cursor.execute(_mark_prepared_sql(connection.vendor, signed is not None), params)


@functools.cache
def _mark_prepared_sql(vendor: str, signed: bool) -> str:
    """The first broadcast's time is kept (COALESCE); the signed transaction's fields are
    written only while none is (the CASE), so a later call never overwrites them."""

    def attempt(name: str) -> str:
        return column(PaymentAttempt, name)

    started = attempt("broadcast_started_at")
    assignments = [f"{started} = COALESCE({started}, %s)", f"{attempt('updated_at')} = %s"]
    if signed:
        tx_hash = attempt("tx_hash")
        unsigned = f"({tx_hash} IS NULL OR {tx_hash} = '')"
        for name in _SIGNED_FIELDS:
            assignments.append(
                f"{attempt(name)} = CASE WHEN {unsigned} THEN %s ELSE {attempt(name)} END"
            )
    return (
        f"UPDATE {table(PaymentAttempt)} SET {', '.join(assignments)} "  # noqa: S608 - names from the model
        f"WHERE {attempt('id')} = %s"
    )


# -- the relayer's nonces ---------------------------------------------------------------------


def relayer_nonce_next(
    *, network: str, address: str, floor: int, now: datetime
) -> tuple[int, datetime, int]:
    """Move the relayer account's counter to at least `floor` and one past its last nonce,
    in one upsert that takes the row lock for one statement. Returns the counter's new
    value, and the lease clock (`pending_seen_since`, `handed_out_by_then`): the chain's
    pending count `floor - 1` is noted, and the clock restarts only when that count moved."""
    sql = _relayer_nonce_sql(connection.vendor)
    with connection.cursor() as cursor:
        cursor.execute(sql, [network, address, floor, now, floor - 1, now, floor])
        next_nonce, seen_since, handed_out = cursor.fetchone()
    if isinstance(seen_since, str):  # SQLite hands raw SQL's timestamps back as UTC text
        seen_since = datetime.fromisoformat(seen_since).replace(tzinfo=UTC)
    return int(next_nonce), seen_since, int(handed_out)


@functools.cache  # its text written once per database vendor
def _relayer_nonce_sql(vendor: str) -> str:
    # SQLite's two-argument MAX is PostgreSQL's GREATEST: the twin is one word.
    greatest = "GREATEST" if vendor == "postgresql" else "MAX"
    accounts = table(RelayerAccount)
    nonce = column(RelayerAccount, "next_nonce")
    updated_at = column(RelayerAccount, "updated_at")
    seen, since, by_then = (
        column(RelayerAccount, name)
        for name in ("pending_seen", "pending_seen_since", "handed_out_by_then")
    )
    fields = ("network", "address", "next_nonce", "updated_at", "pending_seen",
              "pending_seen_since", "handed_out_by_then")  # fmt: skip
    names = ", ".join(column(RelayerAccount, name) for name in fields)
    moved = f"{accounts}.{seen} IS NULL OR {accounts}.{seen} <> excluded.{seen}"
    counter = f"{greatest}({accounts}.{nonce}, excluded.{nonce} - 1) + 1"
    # SET's right-hand sides all read the row as it was before this statement.
    return (
        f"INSERT INTO {accounts} ({names}) VALUES (%s, %s, %s, %s, %s, %s, %s) "  # noqa: S608 - names from the model
        f"ON CONFLICT ({column(RelayerAccount, 'network')}, {column(RelayerAccount, 'address')}) "
        f"DO UPDATE SET {nonce} = {counter}, {updated_at} = excluded.{updated_at}, "
        f"{since} = CASE WHEN {moved} THEN excluded.{since} ELSE {accounts}.{since} END, "
        f"{by_then} = CASE WHEN {moved} THEN {counter} ELSE {accounts}.{by_then} END, "
        f"{seen} = excluded.{seen} "
        f"RETURNING {nonce}, {since}, {by_then}"
    )
