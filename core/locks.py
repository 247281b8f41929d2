"""The one lock helper, and the one lock order every transaction keeps.

A transaction that locks more than one row takes them in this order, and rows of one table
by ascending primary key:

    DuplicateGuard -> Quote -> Purchase -> the purchase's own rows (payment and execution
    attempts, escalations, refunds) -> Buyer (the paying account) -> LedgerBalance

The purchase is the aggregate every flow starts from (it names the account), so the account
comes after it; the account's balance, its child, comes last. Two transactions that keep
one order can wait for each other but never in a cycle.

Rows are locked FOR NO KEY UPDATE: we change their columns, never their keys. That mode does
not conflict with the FOR KEY SHARE PostgreSQL takes on a parent row to check a foreign key,
and Django creates foreign keys DEFERRABLE INITIALLY DEFERRED, so those checks run at COMMIT,
after every lock a transaction took. A FOR UPDATE on a parent (a buyer) therefore closes a
cycle with any transaction that inserted one of its children (a ledger entry, a purchase)
and holds a lock we need next: the deadlock of issue 18 (item 7) was exactly that.

On SQLite (the embedded default) locking a row is a no-op: a writing transaction holds the
whole database already.
"""

from __future__ import annotations

from typing import TypeVar

from django.db import models, transaction

M = TypeVar("M", bound=models.Model)


def lock_rows(queryset: models.QuerySet[M]) -> list[M]:
    """Lock the queryset's rows (of its own table only) FOR NO KEY UPDATE, in ascending pk
    order, and return them. Call it inside the transaction the locks are for, taking tables
    in the order above."""
    assert transaction.get_connection().in_atomic_block, "a lock outlives no transaction"
    return list(queryset.select_for_update(no_key=True, of=("self",)).order_by("pk"))


def locking(queryset: models.QuerySet[M]) -> models.QuerySet[M]:
    """The queryset, to be read under lock_rows' mode (FOR NO KEY UPDATE of its own table),
    for reads that lock one row with .get() or compile once (core.prepared)."""
    return queryset.select_for_update(no_key=True, of=("self",))


def lock_one(model: type[M], pk: int) -> M:
    """Lock one row by pk (see lock_rows). Raises model.DoesNotExist."""
    rows = lock_rows(model._default_manager.filter(pk=pk))
    if not rows:
        raise model.DoesNotExist(f"{model.__name__} {pk} does not exist")  # type: ignore[attr-defined]
    return rows[0]
