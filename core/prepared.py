"""Querysets of a fixed shape, compiled to SQL once per process instead of once per call.

The paid request's hottest reads (a purchase locked with its offering, quote and payment
evidence; the quote a payment names) are querysets whose shape never changes: only their
parameters do. Django compiles them anew every time (building the filters, resolving the
subqueries, writing the SQL), which was most of their CPU (docs/benchmarks.md, issue 11).

A `PreparedQuery` builds its queryset once per database alias and vendor with sentinel
parameters, compiles it with the ORM (so the SQL is exactly the ORM's, on PostgreSQL and on
SQLite alike, `FOR UPDATE` included where the database has it), notes where each sentinel
landed among the statement's parameters, and from then on runs that SQL with the call's
values in those places. Rows become model instances as the ORM's own iterator makes them
(`Model.from_db`, the select_related populators, annotations, the fields' converters).
A parameter the ORM transforms on the way (a `LIKE` pattern, say) cannot be found and is
refused when the query is first compiled, never guessed.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

from django.db import DEFAULT_DB_ALIAS, connections, models, transaction
from django.db.models.query import RelatedPopulator, get_related_populators
from django.db.models.sql import InsertQuery, Query
from django.db.transaction import TransactionManagementError
from django_fsm import ConcurrentTransition, ConcurrentTransitionMixin

M = TypeVar("M", bound=models.Model)

_SENTINEL_INT_BASE = -7_390_000_000_000  # no row or value of ours is ever this
_SENTINEL_EPOCH = datetime(1903, 2, 1, 1, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class _Compiled:
    sql: str
    params: tuple[Any, ...]
    slots: tuple[tuple[int, str], ...]  # (position among the params, parameter name)
    model: type[models.Model]
    fields: slice  # the model's own columns in a row
    init_list: list[str]
    related: list[RelatedPopulator]
    annotations: dict[str, int]
    converters: list[tuple[int, list[Callable[..., Any]], Any]]
    locks: bool  # SELECT ... FOR UPDATE on this database


def _converted(
    row: tuple[Any, ...],
    converters: list[tuple[int, list[Callable[..., Any]], Any]],
    connection: Any,
) -> list[Any]:
    """A fetched row with each column's field converters applied, as the ORM's iterator does."""
    values = list(row)
    for position, column_converters, expression in converters:
        value = values[position]
        for converter in column_converters:
            value = converter(value, expression, connection)
        values[position] = value
    return values


class PreparedQuery(Generic[M]):
    """`build(**parameters)` returns the queryset; `parameters` names each one's type (int,
    str or datetime). The queryset must select model instances (no values(), no only())."""

    def __init__(self, build: Callable[..., models.QuerySet[M]], **parameters: type) -> None:
        self._build = build
        self._parameters = parameters
        self._compiled: dict[tuple[str, str], _Compiled] = {}
        self._lock = threading.Lock()

    def fetch(self, **values: Any) -> list[M]:
        """Every row, as the queryset would return them."""
        return self._fetch(values)[1]

    def _fetch(self, values: dict[str, Any]) -> tuple[_Compiled, list[M]]:
        alias = DEFAULT_DB_ALIAS  # the only database (no routers)
        connection = connections[alias]
        compiled = self._compiled.get((alias, connection.vendor))
        if compiled is None:
            compiled = self._compile(alias)
        if compiled.locks and connection.get_autocommit():
            raise TransactionManagementError(
                "select_for_update cannot be used outside of a transaction."
            )
        params = list(compiled.params)
        for position, name in compiled.slots:
            params[position] = self._prep(name, values[name], connection)
        with connection.cursor() as cursor:
            cursor.execute(compiled.sql, params)
            rows = cursor.fetchall()
        return compiled, [self._instance(compiled, alias, connection, row) for row in rows]

    def get(self, **values: Any) -> M:
        """The one row, or the model's DoesNotExist / MultipleObjectsReturned, like get()."""
        compiled, found = self._fetch(values)
        if len(found) == 1:
            return found[0]
        model = compiled.model
        if not found:
            raise model.DoesNotExist(f"{model._meta.object_name} matching query does not exist.")  # type: ignore[attr-defined]
        raise model.MultipleObjectsReturned(  # type: ignore[attr-defined]
            f"get() returned more than one {model._meta.object_name}"
        )

    def first(self, **values: Any) -> M | None:
        """The first row or None (the queryset orders and limits itself)."""
        found = self.fetch(**values)
        return found[0] if found else None

    def _sentinels(self) -> dict[str, Any]:
        sentinels: dict[str, Any] = {}
        for index, (name, kind) in enumerate(self._parameters.items()):
            if kind is int:
                sentinels[name] = _SENTINEL_INT_BASE - index
            elif kind is str:
                sentinels[name] = f"\x01prepared-parameter-{index}\x01"
            elif kind is datetime:
                sentinels[name] = _SENTINEL_EPOCH.replace(microsecond=index + 1)
            else:
                raise TypeError(f"prepared parameter {name}: int, str or datetime, not {kind}")
        return sentinels

    def _prep(self, name: str, value: Any, connection: Any) -> Any:
        if self._parameters[name] is datetime:
            return models.DateTimeField().get_db_prep_value(value, connection)
        return value

    def _compile(self, alias: str) -> _Compiled:
        connection = connections[alias]
        queryset = self._build(**self._sentinels()).using(alias)
        compiler = queryset.query.get_compiler(using=alias)
        sql, params = compiler.as_sql()
        sentinels = self._sentinels()
        slots: list[tuple[int, str]] = []
        for name, sentinel in sentinels.items():
            prepped = self._prep(name, sentinel, connection)
            positions = [i for i, param in enumerate(params) if param == prepped]
            if not positions:
                raise ValueError(f"prepared parameter {name} does not reach the SQL unchanged")
            slots.extend((position, name) for position in positions)
        klass_info = compiler.klass_info
        select = compiler.select
        assert klass_info is not None, "a prepared query selects model instances"
        select_fields = klass_info["select_fields"]
        start, end = select_fields[0], select_fields[-1] + 1
        converters = compiler.get_converters([column[0] for column in select])
        compiled = _Compiled(
            sql=sql,
            params=tuple(params),
            slots=tuple(slots),
            model=klass_info["model"],
            fields=slice(start, end),
            init_list=[column[0].target.attname for column in select[start:end]],
            related=get_related_populators(klass_info, select, alias),  # type: ignore[call-arg]
            annotations=dict(compiler.annotation_col_map or {}),
            converters=[(pos, convs, expr) for pos, (convs, expr) in converters.items()],
            locks=bool(
                queryset.query.select_for_update and connection.features.has_select_for_update
            ),
        )
        with self._lock:
            self._compiled[(alias, connection.vendor)] = compiled
        return compiled

    @staticmethod
    def _instance(compiled: _Compiled, alias: str, connection: Any, row: tuple[Any, ...]) -> M:
        values = _converted(row, compiled.converters, connection)
        instance = compiled.model.from_db(alias, compiled.init_list, values[compiled.fields])
        for populator in compiled.related:
            populator.populate(values, instance)
        for name, position in compiled.annotations.items():
            setattr(instance, name, values[position])
        return instance  # type: ignore[return-value]


@dataclass(frozen=True)
class _RawShape:
    init_names: list[str]
    init_positions: list[int]
    annotations: list[tuple[str, int]]
    converters: list[tuple[int, list[Callable[..., Any]], Any]]


class PreparedRaw(Generic[M]):
    """A raw statement of ours returning a model's rows, as `Model.objects.raw(sql, params)`
    makes them (columns named after a field's column fill that field, any other column is
    set as an attribute, the fields' converters apply), with what raw() works out on every
    call (the statement's text, which column is which field, the converters) worked out
    once per process: the statement's columns never change, only its parameters do.

    `sql(vendor)` writes the statement for a database vendor; params are a list or a dict,
    adapted as raw() adapts them.
    """

    def __init__(self, model: type[M], sql: Callable[[str], str]) -> None:
        self._model = model
        self._sql = functools.cache(sql)
        self._shapes: dict[tuple[str, str], _RawShape] = {}

    def sql(self) -> str:
        """The statement, as written for the default database."""
        return self._sql(connections[DEFAULT_DB_ALIAS].vendor)

    def fetch(self, params: list[Any] | dict[str, Any]) -> list[M]:
        alias = DEFAULT_DB_ALIAS
        connection = connections[alias]
        vendor = connection.vendor
        adapt = connection.ops.adapt_unknown_value
        adapted = (
            {name: adapt(value) for name, value in params.items()}
            if isinstance(params, dict)
            else [adapt(value) for value in params]
        )
        with connection.cursor() as cursor:
            cursor.execute(self._sql(vendor), adapted)
            rows = cursor.fetchall()
            shape = self._shapes.get((alias, vendor))
            if shape is None:
                shape = self._shape(alias, [column[0] for column in cursor.description])
        model = self._model
        found: list[M] = []
        for row in rows:
            values = _converted(row, shape.converters, connection)
            instance = model.from_db(
                alias, shape.init_names, [values[pos] for pos in shape.init_positions]
            )
            for name, position in shape.annotations:
                setattr(instance, name, values[position])
            found.append(instance)
        return found

    def _shape(self, alias: str, described: list[str]) -> _RawShape:
        """RawQuerySet's column resolution (resolve_model_init_order, its converters)."""
        connection = connections[alias]
        identifier = connection.introspection.identifier_converter
        columns = [identifier(name) for name in described]
        by_column = {identifier(str(f.column)): f for f in self._model._meta.fields}
        pk = self._model._meta.pk
        assert pk is not None
        init = [f for f in self._model._meta.fields if identifier(str(f.column)) in columns]
        if pk.attname not in {f.attname for f in init}:
            raise ValueError("a prepared raw statement must select the primary key")
        cols = [
            field.get_col(field.model._meta.db_table) if field is not None else None
            for field in (by_column.get(column) for column in columns)
        ]
        compiler = connection.ops.compiler("SQLCompiler")(Query(self._model), connection, alias)
        converters = compiler.get_converters(cols)  # type: ignore[arg-type]  # None: no field
        shape = _RawShape(
            init_names=[f.attname for f in init],
            init_positions=[columns.index(identifier(str(f.column))) for f in init],
            annotations=[(c, pos) for pos, c in enumerate(columns) if c not in by_column],
            converters=[(pos, convs, expr) for pos, (convs, expr) in converters.items()],
        )
        self._shapes[(alias, connection.vendor)] = shape
        return shape


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
