"""Writes of a fixed shape (FSM saves, new rows), their SQL written once per process."""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, models, transaction
from django.db.models.sql import InsertQuery, Query
from django_fsm import ConcurrentTransition, ConcurrentTransitionMixin


class PreparedTransitionMixin(ConcurrentTransitionMixin):
    """django-fsm's ConcurrentTransitionMixin with its conditional UPDATE written once per
    shape (the columns saved) instead of compiled by the ORM on every save.

    The statement is the mixin's: `UPDATE ... SET <saved columns> WHERE pk = %s AND <each
    state column> = <the state it was read in>`, and no row updated for a row that exists
    is ConcurrentTransition, as before. Anything this does not cover exactly (an expression
    as a value, a field with a placeholder of its own, inheritance, select_on_save) goes
    through the mixin unchanged.
    """

    def _do_update(  # type: ignore[override]  # the stubs have Django 6's signature
        self,
        base_qs: models.QuerySet[Any],
        using: str | None,
        pk_val: Any,
        values: Collection[tuple[models.Field[Any, Any], Any, Any]],
        update_fields: Iterable[str] | None,
        forced_update: bool,
        returning_fields: bool | None = None,
    ) -> bool:
        alias = using or DEFAULT_DB_ALIAS
        states: dict[str, Any] = self._ConcurrentTransitionMixin__initial_states  # type: ignore[attr-defined]
        meta = self._meta
        if (
            returning_fields is not None
            or not values
            or meta.select_on_save
            or meta.parents
            or base_qs.query.where
            or any(value is None for value in states.values())
            or any(_needs_the_orm(field, value) for field, _model, value in values)
        ):
            return super()._do_update(  # type: ignore[no-any-return]
                base_qs, using, pk_val, values, update_fields, forced_update
            )
        connection = connections[alias]
        columns = tuple(field.column for field, _model, _value in values)
        state_fields = tuple(f for f in meta.concrete_fields if f.attname in states)
        sql = _update_sql(
            type(self), alias, connection.vendor, columns, tuple(f.column for f in state_fields)
        )
        params = [field.get_db_prep_save(value, connection) for field, _model, value in values]
        params.append(meta.pk.get_db_prep_value(pk_val, connection))  # type: ignore[union-attr]
        params.extend(f.get_db_prep_value(states[f.attname], connection) for f in state_fields)
        with transaction.mark_for_rollback_on_error(using=alias), connection.cursor() as cursor:
            cursor.execute(sql, params)
            updated = cursor.rowcount
        if not updated and base_qs.filter(pk=pk_val).using(alias).exists():
            raise ConcurrentTransition(
                "Cannot save object! The state has been changed since fetched from the database!"
            )
        return updated > 0

    def _do_insert(  # type: ignore[override]
        self,
        manager: models.Manager[Any],
        using: str | None,
        fields: list[models.Field[Any, Any]],
        returning_fields: list[models.Field[Any, Any]] | None,
        raw: bool,
    ) -> Any:
        """A new row's INSERT, written once per shape instead of compiled on every save."""
        if not raw and not self._meta.parents:
            inserted = _prepared_insert(self, using or DEFAULT_DB_ALIAS, fields, returning_fields)
            if inserted is not None:
                return inserted
        return super()._do_insert(manager, using, fields, returning_fields, raw)  # type: ignore[misc]


@dataclass(frozen=True)
class _InsertShape:
    sql: str
    returning_params: Any
    returning_columns: list[Any]


_insert_shapes: dict[tuple[Any, ...], _InsertShape] = {}


def _prepared_insert(
    instance: models.Model,
    alias: str,
    fields: list[models.Field[Any, Any]],
    returning_fields: list[models.Field[Any, Any]] | None,
) -> list[tuple[Any, ...]] | None:
    """One row's INSERT as the ORM runs it, its SQL compiled once per shape (the fields
    saved and returned): the row's values, as the ORM prepares them, and the returned
    columns, converted. None when the ORM must do it (an expression as a value, a field
    with a placeholder of its own, a database that cannot return the columns)."""
    connection = connections[alias]
    if returning_fields and not connection.features.can_return_columns_from_insert:
        return None
    if any(
        hasattr(field, "get_placeholder")
        or _needs_the_orm(field, instance.__dict__.get(field.attname))
        for field in fields
    ):
        return None
    values = [field.pre_save(instance, True) for field in fields]  # type: ignore[arg-type]
    if any(_needs_the_orm(field, value) for field, value in zip(fields, values, strict=True)):
        return None  # pre_save made an expression: never seen here, and never guessed
    key = (
        type(instance),
        alias,
        connection.vendor,
        tuple(field.attname for field in fields),
        tuple(field.attname for field in returning_fields or ()),
    )
    shape = _insert_shapes.get(key)
    if shape is None:
        shape = _insert_shapes[key] = _insert_shape(instance, alias, fields, returning_fields)
    params = [
        field.get_db_prep_save(value, connection)
        for field, value in zip(fields, values, strict=True)
    ]
    with connection.cursor() as cursor:
        cursor.execute(shape.sql, params)
        if not returning_fields:
            return []
        row = connection.ops.fetch_returned_insert_columns(cursor, shape.returning_params)  # type: ignore[attr-defined]
    compiler = connection.ops.compiler("SQLCompiler")(Query(type(instance)), connection, alias)
    converters = compiler.get_converters(shape.returning_columns)
    rows: Iterable[Any] = [row]
    if converters:
        rows = compiler.apply_converters(rows, converters)
    return [tuple(found) for found in rows]


def _insert_shape(
    instance: models.Model,
    alias: str,
    fields: list[models.Field[Any, Any]],
    returning_fields: list[models.Field[Any, Any]] | None,
) -> _InsertShape:
    """The ORM's own INSERT for this shape (compiled raw: nothing pre-saved twice)."""
    query = InsertQuery(type(instance))
    query.insert_values(fields, [instance], raw=True)
    compiler = query.get_compiler(using=alias)
    compiler.returning_fields = returning_fields  # type: ignore[attr-defined]
    [(sql, _params)] = compiler.as_sql()  # type: ignore[attr-defined]
    table = instance._meta.db_table
    return _InsertShape(
        sql=sql,
        returning_params=getattr(compiler, "returning_params", ()),
        returning_columns=[field.get_col(table) for field in returning_fields or ()],
    )


def _needs_the_orm(field: models.Field[Any, Any], value: Any) -> bool:
    return (
        hasattr(field, "get_placeholder")
        or hasattr(value, "resolve_expression")
        or hasattr(value, "as_sql")
        or hasattr(value, "prepare_database_save")
    )


@functools.cache
def _update_sql(
    model: type[models.Model],
    alias: str,
    vendor: str,
    columns: tuple[str, ...],
    state_columns: tuple[str, ...],
) -> str:
    quote = connections[alias].ops.quote_name
    table = quote(model._meta.db_table)
    assignments = ", ".join(f"{quote(column)} = %s" for column in columns)
    pk_column = str(model._meta.pk.column)  # type: ignore[union-attr]
    conditions = " AND ".join(
        f"{table}.{quote(column)} = %s" for column in (pk_column, *state_columns)
    )
    return f"UPDATE {table} SET {assignments} WHERE {conditions}"  # noqa: S608 - names from the model
