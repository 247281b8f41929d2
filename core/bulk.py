"""Writing many rows' changed columns in one statement."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

from django.db import connection
from django.db.models import Field, Model

from core.prepared.inserts import insert_rows, insert_shape, insert_sql, insert_values


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


def insert_unless_conflict(
    obj: Model, *, conflict: str, also: tuple[str, list[Any]] | None = None
) -> bool:
    """INSERT `obj` unless a unique index refuses it: `INSERT ... ON CONFLICT <conflict> DO
    NOTHING RETURNING pk`, one statement and never a failing INSERT (no ERROR in the
    database's log, no savepoint to roll back). Sets obj.pk and returns True when the row
    went in; False when `conflict` (e.g. `(quote_key) WHERE state = 'open'`, naming a
    partial unique index) already had one. PostgreSQL and SQLite (3.35+) both speak it.
    No signals; values prepared as the ORM prepares a new row's (auto_now_add included).
    The text is written once per model and conflict (core.prepared.inserts).

    `also`: (sql, params) of a statement that follows the INSERT in the same statement, as
    a data-modifying CTE reading the new row from `inserted` (PostgreSQL only: pass None
    elsewhere and write it after).
    """
    sql = _unless_conflict_sql(type(obj), connection.alias, connection.vendor, conflict)
    params = insert_values([obj])
    if also is not None:
        also_sql, also_params = also
        sql = f"WITH inserted AS ({sql}), also AS ({also_sql}) SELECT * FROM inserted"  # noqa: S608 (both built from models)
        params += also_params
    return insert_returning_pk(obj, sql, params)


@functools.cache
def _unless_conflict_sql(model: type[Model], alias: str, vendor: str, conflict: str) -> str:
    pk = insert_shape(model).pk
    return f"{insert_sql(model, alias, vendor)} ON CONFLICT {conflict} DO NOTHING RETURNING {pk}"


def insert_returning_pk(obj: Model, sql: str, params: Any) -> bool:
    """Run `sql`, an INSERT of `obj`'s row ending in `RETURNING <pk>` (it may write nothing),
    and make `obj` that saved row. Returns whether a row was written."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    if row is None:
        return False
    obj.pk = row[0]
    obj._state.adding = False
    return True


def insert_after(obj: Model, *, new_id_into: str | None = None) -> tuple[str, list[Any]]:
    """`obj`'s INSERT as the `also` of insert_unless_conflict (PostgreSQL): written only if
    that row went in, with its id in the field `new_id_into` when given. Every value is cast
    to its column's type (they are a SELECT's outputs, not VALUES). The text is written once
    per model and field."""
    sql, new_id_at = _after_sql(type(obj), connection.alias, connection.vendor, new_id_into)
    params = insert_values([obj])
    if new_id_at is not None:
        del params[new_id_at]  # the statement reads it from the new row
    return sql, params


@functools.cache
def _after_sql(
    model: type[Model], alias: str, vendor: str, new_id_into: str | None
) -> tuple[str, int | None]:
    """insert_after's text, and where among the row's values the new row's id goes."""
    shape = insert_shape(model)
    names = [field.name for field in shape.fields]
    values = [
        "inserted.id" if name == new_id_into else f"%s::{cast}"
        for name, cast in zip(names, shape.casts, strict=True)
    ]
    sql = (
        f"INSERT INTO {shape.table} ({', '.join(shape.columns)}) "  # noqa: S608 (names from models)
        f"SELECT {', '.join(values)} FROM inserted"
    )
    return sql, names.index(new_id_into) if new_id_into is not None else None


def bulk_insert_rows(objs: Sequence[Model], *, copy_from: int = 200) -> None:
    """INSERT every object (none saved yet, ids left to the database), as bulk_create would:
    same pre_save values (auto_now_add), no signals, ids not read back.

    From `copy_from` objects on PostgreSQL, one COPY instead of one INSERT with a
    placeholder per value: Django compiles that statement row by row and the server parses
    all of it, which at thousands of rows costs more than the writes themselves. Fewer
    objects (a request's few events) go in one INSERT, which query counts see, its text
    written once per row count (core.prepared.inserts.insert_rows).
    """
    if not objs:
        return
    if connection.vendor != "postgresql" or len(objs) < copy_from:
        insert_rows(objs)
        return
    shape = insert_shape(type(objs[0]))
    sql = f"COPY {shape.table} ({', '.join(shape.columns)}) FROM STDIN"
    width = len(shape.fields)
    values = insert_values(objs)
    with connection.cursor() as cursor, cursor.cursor.copy(sql) as copy:
        for start in range(0, len(values), width):
            copy.write_row(values[start : start + width])
