"""The fulfillment app's one hand-written write, beside its SQLite twin (docs/architecture.md,
"Where the SQL lives"; tests/test_sql_twins.py runs both)."""

from __future__ import annotations

from core.bulk import insert_after, insert_unless_conflict
from core.sql import on_postgresql
from fulfillment.models import Receipt, Result


def result_insert_with_receipt(*, result: Result, receipt: Receipt) -> bool:
    """INSERT the result unless its purchase has one, and its receipt with it: one statement
    on PostgreSQL (the receipt's INSERT follows the result's in a CTE); the twin saves the
    receipt after the result. False, and nothing written, when the purchase had a result."""
    postgresql = on_postgresql()
    also = insert_after(receipt) if postgresql else None
    if not insert_unless_conflict(result, conflict="(purchase_id)", also=also):
        return False
    if not postgresql:
        receipt.save(force_insert=True)
    return True
