"""Changes to rows of a fixed shape, their SQL written once per process, not compiled per call.

- `PreparedTransitionMixin`: an FSM model's saves, django-fsm's conditional UPDATE and a new
  row's INSERT (core.prepared.inserts), each written once per shape (the columns saved).
- `PreparedUpdate`: a queryset's update() of a fixed shape, compiled once.

What they do not cover exactly (an expression as a value, a field with a placeholder of its
own, model inheritance) goes through the ORM unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, models, transaction
from django.db.models.sql import UpdateQuery
from django_fsm import ConcurrentTransition, ConcurrentTransitionMixin

from core.prepared.inserts import is_expression, prepared_insert
from core.prepared.reads import Parameters


class PreparedTransitionMixin(ConcurrentTransitionMixin):
    """django-fsm's ConcurrentTransitionMixin with its conditional UPDATE written once per
    shape (the columns saved) instead of compiled by the ORM on every save.

    The statement is the mixin's: `UPDATE ... SET <saved columns> WHERE pk = %s AND <each
    state column> = <the state it was read in>` (and `_save_guard`'s columns), and no row
    updated for a row that exists is ConcurrentTransition, as before. Anything this does not
    cover exactly (an expression as a value, a field with a placeholder of its own,
    inheritance, select_on_save) goes through the mixin unchanged.
    """

    def _save_guard(self) -> dict[str, Any]:
        """Columns (attname: value) the row must still hold for a save to write, besides its
        states: a save over a row that no longer holds them writes nothing and raises
        ConcurrentTransition, like a save over a moved state."""
        return {}

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
        guard = self._save_guard()
        meta = self._meta
        if (
            returning_fields is not None
            or not values
            or meta.select_on_save
            or meta.parents
            or base_qs.query.where
            or any(value is None for value in (*states.values(), *guard.values()))
            or any(_needs_the_orm(field, value) for field, _model, value in values)
        ):
            updated = super()._do_update(
                base_qs.filter(**guard), using, pk_val, values, update_fields, forced_update
            )
            if updated or not guard:
                return bool(updated)  # the mixin raised already over a moved state
        else:
            updated = self._prepared_update(alias, pk_val, values, {**states, **guard})
        if not updated and base_qs.filter(pk=pk_val).using(alias).exists():
            raise ConcurrentTransition(
                "Cannot save object! The state has been changed since fetched from the database!"
            )
        return bool(updated)

    def _prepared_update(
        self,
        alias: str,
        pk_val: Any,
        values: Collection[tuple[models.Field[Any, Any], Any, Any]],
        held: dict[str, Any],
    ) -> int:
        """The conditional UPDATE: `values` where the row still holds `held`. Rows written."""
        connection = connections[alias]
        meta = self._meta
        columns = tuple(field.column for field, _model, _value in values)
        held_fields = tuple(f for f in meta.concrete_fields if f.attname in held)
        sql = _update_sql(
            type(self), alias, connection.vendor, columns, tuple(f.column for f in held_fields)
        )
        params = [field.get_db_prep_save(value, connection) for field, _model, value in values]
        params.append(meta.pk.get_db_prep_value(pk_val, connection))  # type: ignore[union-attr]
        params.extend(f.get_db_prep_value(held[f.attname], connection) for f in held_fields)
        with transaction.mark_for_rollback_on_error(using=alias), connection.cursor() as cursor:
            cursor.execute(sql, params)
            return int(cursor.rowcount)

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
            inserted = prepared_insert(self, using or DEFAULT_DB_ALIAS, fields, returning_fields)
            if inserted is not None:
                return inserted
        return super()._do_insert(manager, using, fields, returning_fields, raw)  # type: ignore[misc]


@dataclass(frozen=True)
class _CompiledUpdate:
    sql: str
    params: tuple[Any, ...]
    slots: tuple[tuple[int, str], ...]


class PreparedUpdate:
    """`queryset.update(**values)` compiled once per process and database, as PreparedQuery
    compiles a read: `build(**parameters)` returns the queryset and the values it sets,
    `parameters` names each one's type (int, str or datetime). An UPDATE the ORM runs as
    more than one statement (a parent model's table) is refused when first compiled."""

    def __init__(
        self,
        build: Callable[..., tuple[models.QuerySet[Any], dict[str, Any]]],
        **parameters: type,
    ) -> None:
        self._build = build
        self._parameters = Parameters(parameters)
        self._compiled: dict[tuple[str, str], _CompiledUpdate] = {}

    def run(self, **values: Any) -> int:
        """The UPDATE with these parameters; the rows it wrote, as update() returns."""
        alias = DEFAULT_DB_ALIAS  # the only database (no routers)
        connection = connections[alias]
        compiled = self._compiled.get((alias, connection.vendor))
        if compiled is None:
            compiled = self._compiled[(alias, connection.vendor)] = self._compile(alias)
        params = self._parameters.bind(compiled.params, compiled.slots, values, connection)
        with transaction.mark_for_rollback_on_error(using=alias), connection.cursor() as cursor:
            cursor.execute(compiled.sql, params)
            return int(cursor.rowcount)

    def _compile(self, alias: str) -> _CompiledUpdate:
        """What QuerySet.update() compiles, taken before it runs."""
        queryset, values = self._build(**self._parameters.sentinels())
        query = queryset.query.chain(UpdateQuery)
        assert isinstance(query, UpdateQuery)
        query.add_update_values(values)
        query.clear_select_clause()
        if query.get_related_updates():
            raise ValueError("a prepared update writes one table")
        sql, params = query.get_compiler(using=alias).as_sql()
        return _CompiledUpdate(
            sql=sql, params=tuple(params), slots=self._parameters.slots(params, connections[alias])
        )


def _needs_the_orm(field: models.Field[Any, Any], value: Any) -> bool:
    return hasattr(field, "get_placeholder") or is_expression(value)


@functools.cache
def _update_sql(
    model: type[models.Model],
    alias: str,
    vendor: str,
    columns: tuple[str, ...],
    held_columns: tuple[str, ...],
) -> str:
    quote = connections[alias].ops.quote_name
    table = quote(model._meta.db_table)
    assignments = ", ".join(f"{quote(column)} = %s" for column in columns)
    pk_column = str(model._meta.pk.column)  # type: ignore[union-attr]
    conditions = " AND ".join(
        f"{table}.{quote(column)} = %s" for column in (pk_column, *held_columns)
    )
    return f"UPDATE {table} SET {assignments} WHERE {conditions}"  # noqa: S608 - names from the model
