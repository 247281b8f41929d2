"""Writing many rows' changed columns in one statement."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from django.db import connection
from django.db.models import Field, Model


def bulk_update_columns(objs: Iterable[Model], fields: Sequence[str]) -> int:
    """UPDATE `fields` of every object from its in-memory values, in one statement.

    Django's bulk_update builds a CASE WHEN per field with one branch per row: its cost
    grows with rows x rows in Python and in the planner. On PostgreSQL this is one
    UPDATE ... FROM UNNEST(one array per column) joined on the primary key instead;
    elsewhere it falls back to bulk_update. Writes only what it is told: no auto_now, no
    signals, no FSM checks (callers hold the row locks and made the transitions
    themselves). Returns rows written.
    """
    rows = list(objs)
    if not rows:
        return 0
    model = type(rows[0])
    if connection.vendor != "postgresql":
        return int(model._default_manager.bulk_update(rows, fields))
    meta = model._meta
    columns: list[Field[Any, Any]] = [meta.pk, *(meta.get_field(name) for name in fields)]  # type: ignore[list-item]
    # One array parameter per column (UNNEST), not one placeholder per value: the statement
    # stays small however many rows it carries.
    arrays: list[list[Any]] = [
        [field.get_db_prep_save(getattr(obj, field.attname), connection) for obj in rows]
        for field in columns
    ]
    quote = connection.ops.quote_name
    names = [quote(field.column or field.name) for field in columns]
    unnest = ", ".join(f"%s::{field.cast_db_type(connection) or 'text'}[]" for field in columns)
    assignments = ", ".join(f"{name} = v.{name}" for name in names[1:])
    sql = (
        f"UPDATE {quote(meta.db_table)} AS t SET {assignments} "  # noqa: S608 (names from models)
        f"FROM UNNEST({unnest}) AS v({', '.join(names)}) "
        f"WHERE t.{names[0]} = v.{names[0]}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, arrays)
        return int(cursor.rowcount)
