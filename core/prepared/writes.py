"""Writes of a fixed shape, their SQL written once per process instead of compiled per call.

- `PreparedTransitionMixin`: an FSM model's saves, django-fsm's conditional UPDATE and a new
  row's INSERT, each written once per shape (the columns saved and returned).
- `PreparedUpdate`: a queryset's update() of a fixed shape, compiled once.
- `insert_rows`, `insert_statement_of` and their parts (`insert_shape`, `insert_sql`,
  `insert_values`): new rows written by hand (several in one statement, or inside a
  statement of ours), the INSERT's text written once per model and row count.

Values are prepared as the ORM prepares them (`pre_save` for a new row, so `auto_now_add`
and the like, then `get_db_prep_save`); returned columns are converted as it converts them.
What they do not cover exactly (an expression as a value, a field with a placeholder of its
own, model inheritance) goes through the ORM unchanged, or is refused where nothing else can
write it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, models, transaction
from django.db.models.sql import InsertQuery, Query, UpdateQuery
from django_fsm import ConcurrentTransition, ConcurrentTransitionMixin

from core.prepared.reads import Parameters, converted


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
            inserted = _prepared_insert(self, using or DEFAULT_DB_ALIAS, fields, returning_fields)
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


@dataclass(frozen=True)
class _SavedInsertShape:
    sql: str
    by_hand: bool  # no field with a placeholder of its own
    returning_params: Any
    returning_converters: list[tuple[int, list[Callable[..., Any]], Any]]


_saved_insert_shapes: dict[tuple[Any, ...], _SavedInsertShape] = {}


def _prepared_insert(
    instance: models.Model,
    alias: str,
    fields: list[models.Field[Any, Any]],
    returning_fields: list[models.Field[Any, Any]] | None,
) -> list[tuple[Any, ...]] | None:
    """One row's INSERT as the ORM runs it from save(), its SQL compiled once per shape (the
    fields saved and returned): the row's values, as the ORM prepares them, and the returned
    columns, converted. None when the ORM must do it (an expression as a value, a field
    with a placeholder of its own, a database that cannot return the columns)."""
    connection = connections[alias]
    if returning_fields and not connection.features.can_return_columns_from_insert:
        return None
    key = (
        type(instance),
        alias,
        connection.vendor,
        tuple(field.attname for field in fields),
        tuple(field.attname for field in returning_fields or ()),
    )
    shape = _saved_insert_shapes.get(key)
    if shape is None:
        shape = _saved_insert_shapes[key] = _saved_insert_shape(
            instance, alias, fields, returning_fields
        )
    if not shape.by_hand:
        return None
    params = _row_params(instance, fields, connection)
    if params is None:
        return None
    with connection.cursor() as cursor:
        cursor.execute(shape.sql, params)
        if not returning_fields:
            return []
        row = connection.ops.fetch_returned_insert_columns(cursor, shape.returning_params)  # type: ignore[attr-defined]
    return [tuple(converted(row, shape.returning_converters, connection))]


def _saved_insert_shape(
    instance: models.Model,
    alias: str,
    fields: list[models.Field[Any, Any]],
    returning_fields: list[models.Field[Any, Any]] | None,
) -> _SavedInsertShape:
    """The ORM's own INSERT for this shape (compiled raw: nothing pre-saved twice)."""
    model = type(instance)
    query = InsertQuery(model)
    query.insert_values(fields, [instance], raw=True)
    compiler = query.get_compiler(using=alias)
    compiler.returning_fields = returning_fields  # type: ignore[attr-defined]
    [(sql, _params)] = compiler.as_sql()  # type: ignore[attr-defined]
    table = model._meta.db_table
    connection = connections[alias]
    columns = [field.get_col(table) for field in returning_fields or ()]
    selecting = connection.ops.compiler("SQLCompiler")(Query(model), connection, alias)
    converters = selecting.get_converters(columns)  # type: ignore[arg-type]
    return _SavedInsertShape(
        sql=sql,
        by_hand=not any(hasattr(field, "get_placeholder") for field in fields),
        returning_params=getattr(compiler, "returning_params", ()),
        returning_converters=[(pos, convs, expr) for pos, (convs, expr) in converters.items()],
    )


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


@functools.lru_cache(maxsize=256)
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
    limit = connection.features.max_query_params
    if not shape.by_hand or (limit and len(objs) * len(shape.fields) > limit):
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
    if any(_is_expression(value) for value in values):
        return None
    return [
        field.get_db_prep_save(value, connection)
        for field, value in zip(fields, values, strict=True)
    ]


_EXPRESSION_TYPES: dict[type, bool] = {}


def _is_expression(value: Any) -> bool:
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


def _needs_the_orm(field: models.Field[Any, Any], value: Any) -> bool:
    return hasattr(field, "get_placeholder") or _is_expression(value)


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
