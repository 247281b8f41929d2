"""New rows written by hand, their INSERT's text written once per model and row count.

`insert_rows`, `insert_statement_of` and their parts `insert_shape`, `insert_sql`,
`insert_values`: several rows in one statement, or inside a statement of ours (an app's
`sql.py`). A save() of one new row goes through the ORM.

Values are prepared as the ORM prepares them (`pre_save` for a new row, so `auto_now_add`
and the like, then `get_db_prep_save`); returned columns are converted as it converts them.
What this does not cover exactly (an expression as a value, a field with a placeholder of
its own, model inheritance) goes through the ORM, or is refused where nothing else can
write it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, models

# PostgreSQL's wire protocol counts a statement's parameters in 16 bits (Django sets no
# limit there: its bulk_create sends one array per column instead).
_PROTOCOL_MAX_PARAMS = 65_535


@dataclass(frozen=True)
class InsertShape:
    """A model's new row on one database: every concrete field but an auto primary key, in
    the ORM's order, and their columns quoted for a statement of ours."""

    fields: tuple[models.Field[Any, Any], ...]
    table: str
    columns: tuple[str, ...]
    casts: tuple[str, ...]  # each column's type, for values selected rather than listed
    pk: str
    by_hand: bool  # no field with a placeholder of its own, no parent table


def insert_shape(model: type[models.Model]) -> InsertShape:
    """`model`'s InsertShape on the default database, worked out once per process."""
    connection = connections[DEFAULT_DB_ALIAS]
    return _insert_shape(model, connection.alias, connection.vendor)


@functools.cache
def _insert_shape(model: type[models.Model], alias: str, vendor: str) -> InsertShape:
    connection = connections[alias]
    meta = model._meta
    quote = connection.ops.quote_name
    fields = tuple(
        f
        for f in meta.local_concrete_fields
        if f is not meta.auto_field and not getattr(f, "generated", False)
    )
    return InsertShape(
        fields=fields,
        table=quote(meta.db_table),
        columns=tuple(quote(str(f.column)) for f in fields),
        casts=tuple(str(f.cast_db_type(connection)) for f in fields),
        pk=quote(str(meta.pk.column)),  # type: ignore[union-attr]
        by_hand=not meta.parents and not any(hasattr(f, "get_placeholder") for f in fields),
    )


@functools.lru_cache(maxsize=64)  # row counts seen: a request's events, a bulk writer's chunks
def insert_sql(model: type[models.Model], alias: str, vendor: str, rows: int = 1) -> str:
    """`INSERT INTO <table> (<InsertShape's columns>) VALUES (%s, ...), ...` for `rows`
    rows, the form the ORM writes, once per model, database and row count."""
    shape = _insert_shape(model, alias, vendor)
    row = f"({', '.join(['%s'] * len(shape.fields))})"
    return (
        f"INSERT INTO {shape.table} ({', '.join(shape.columns)}) VALUES {', '.join([row] * rows)}"  # noqa: S608 - names from the model
    )


def insert_values(objs: Sequence[models.Model]) -> list[Any]:
    """The new rows' values for InsertShape's columns, one row after the other, as the ORM
    prepares them. Raises ValueError for a value only the ORM can write (an expression)."""
    connection = connections[DEFAULT_DB_ALIAS]
    params: list[Any] = []
    for obj in objs:
        row = _row_params(obj, insert_shape(type(obj)).fields, connection)
        if row is None:
            raise ValueError(f"{type(obj).__name__}: an expression cannot be written by hand")
        params.extend(row)
    return params


def insert_rows(objs: Sequence[models.Model]) -> None:
    """INSERT the new rows (one model's, none saved) in one statement, as bulk_create does
    (same values, no signals) but with its text written once per row count; ids are not
    read back. The ORM's bulk_create does what this cannot (an expression, a placeholder of
    a field's own, a primary key set, more parameters than the database takes at once)."""
    statement = _insert_statement(objs)
    if statement is None:
        type(objs[0])._default_manager.bulk_create(objs)
        return
    sql, params = statement
    with connections[DEFAULT_DB_ALIAS].cursor() as cursor:
        cursor.execute(sql, params)


def insert_statement_of(objs: Sequence[models.Model]) -> tuple[str, list[Any]]:
    """insert_rows' statement and parameters, for a statement of ours to carry. Raises
    ValueError for rows only the ORM can write."""
    statement = _insert_statement(objs)
    if statement is None:
        raise ValueError(f"{type(objs[0]).__name__}: these rows cannot be written by hand")
    return statement


def _insert_statement(objs: Sequence[models.Model]) -> tuple[str, list[Any]] | None:
    connection = connections[DEFAULT_DB_ALIAS]
    model = type(objs[0])
    shape = insert_shape(model)
    limit = connection.features.max_query_params or _PROTOCOL_MAX_PARAMS
    if not shape.by_hand or len(objs) * len(shape.fields) > limit:
        return None
    params: list[Any] = []
    for obj in objs:
        if obj.pk is not None:
            return None
        obj._prepare_related_fields_for_save(operation_name="bulk_create")  # type: ignore[attr-defined]  # as bulk_create
        row = _row_params(obj, shape.fields, connection)
        if row is None:
            return None
        params.extend(row)
    return insert_sql(model, connection.alias, connection.vendor, len(objs)), params


def _row_params(
    obj: models.Model, fields: Sequence[models.Field[Any, Any]], connection: Any
) -> list[Any] | None:
    """`obj`'s values for `fields` as the ORM prepares a new row's, or None when one is an
    expression only the ORM can write (pre_save may make one: it is looked at after)."""
    values = [field.pre_save(obj, True) for field in fields]  # type: ignore[arg-type]
    if any(is_expression(value) for value in values):
        return None
    return [
        field.get_db_prep_save(value, connection)
        for field, value in zip(fields, values, strict=True)
    ]


_EXPRESSION_TYPES: dict[type, bool] = {}


def is_expression(value: Any) -> bool:
    """Whether the ORM must write `value` (an expression, a subquery, a model instance),
    decided once per type: the values saved are nearly all of a few plain types."""
    kind = type(value)
    found = _EXPRESSION_TYPES.get(kind)
    if found is None:
        found = _EXPRESSION_TYPES[kind] = any(
            hasattr(kind, name)
            for name in ("resolve_expression", "as_sql", "prepare_database_save")
        )
    return found
