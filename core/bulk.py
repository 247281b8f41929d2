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


def insert_unless_conflict(
    obj: Model, *, conflict: str, also: tuple[str, list[Any]] | None = None
) -> bool:
    """INSERT `obj` unless a unique index refuses it: `INSERT ... ON CONFLICT <conflict> DO
    NOTHING RETURNING pk`, one statement and never a failing INSERT (no ERROR in the
    database's log, no savepoint to roll back). Sets obj.pk and returns True when the row
    went in; False when `conflict` (e.g. `(quote_key) WHERE state = 'open'`, naming a
    partial unique index) already had one. PostgreSQL and SQLite (3.35+) both speak it.
    No signals, no auto_now: callers set every value.

    `also`: (sql, params) of a statement that follows the INSERT in the same statement, as
    a data-modifying CTE reading the new row from `inserted` (PostgreSQL only: pass None
    elsewhere and write it after).
    """
    meta = obj._meta
    fields = [f for f in meta.concrete_fields if not f.primary_key]
    quote = connection.ops.quote_name
    sql = (
        f"INSERT INTO {quote(meta.db_table)} ({', '.join(quote(str(f.column)) for f in fields)}) "  # noqa: S608 (names from models)
        f"VALUES ({', '.join(['%s'] * len(fields))}) "
        f"ON CONFLICT {conflict} DO NOTHING RETURNING {quote(str(meta.pk.column))}"
    )
    params = [f.get_db_prep_save(f.pre_save(obj, add=True), connection) for f in fields]
    if also is not None:
        also_sql, also_params = also
        sql = f"WITH inserted AS ({sql}), also AS ({also_sql}) SELECT * FROM inserted"  # noqa: S608 (both built from models)
        params += also_params
    return insert_returning_pk(obj, sql, params)


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
    to its column's type (they are a SELECT's outputs, not VALUES)."""
    meta = obj._meta
    quote = connection.ops.quote_name
    columns: list[str] = []
    values: list[str] = []
    params: list[Any] = []
    for field in meta.concrete_fields:
        if field.primary_key:
            continue
        columns.append(quote(str(field.column)))
        if field.name == new_id_into:
            values.append("inserted.id")
            continue
        values.append(f"%s::{field.cast_db_type(connection)}")
        params.append(field.get_db_prep_save(field.pre_save(obj, add=True), connection))
    sql = (
        f"INSERT INTO {quote(meta.db_table)} ({', '.join(columns)}) "  # noqa: S608 (names from models)
        f"SELECT {', '.join(values)} FROM inserted"
    )
    return sql, params


def bulk_insert_rows(objs: Sequence[Model], *, copy_from: int = 200) -> None:
    """INSERT every object (none saved yet, ids left to the database), as bulk_create would:
    same pre_save values (auto_now_add), no signals, ids not read back.

    From `copy_from` objects on PostgreSQL, one COPY instead of one INSERT with a
    placeholder per value: Django compiles that statement row by row and the server parses
    all of it, which at thousands of rows costs more than the writes themselves. Fewer
    objects (a request's few events) keep the ordinary bulk_create, which query counts see.
    """
    if not objs:
        return
    model = type(objs[0])
    if connection.vendor != "postgresql" or len(objs) < copy_from:
        model._default_manager.bulk_create(objs)
        return
    meta = model._meta
    fields = [f for f in meta.concrete_fields if not f.primary_key]
    quote = connection.ops.quote_name
    columns = ", ".join(quote(f.column or f.name) for f in fields)
    sql = f"COPY {quote(meta.db_table)} ({columns}) FROM STDIN"
    with connection.cursor() as cursor, cursor.cursor.copy(sql) as copy:
        for obj in objs:
            copy.write_row([f.get_db_prep_save(f.pre_save(obj, True), connection) for f in fields])
