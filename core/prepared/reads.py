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

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

from django.db import DEFAULT_DB_ALIAS, connections, models
from django.db.models.query import RelatedPopulator, get_related_populators
from django.db.transaction import TransactionManagementError

M = TypeVar("M", bound=models.Model)

_SENTINEL_INT_BASE = -7_390_000_000_000  # no row or value of ours is ever this
_SENTINEL_EPOCH = datetime(1903, 2, 1, 1, 1, 1, tzinfo=UTC)
_DATETIME = models.DateTimeField()  # prepares a datetime parameter as the ORM does


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


def converted(
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


class Parameters:
    """A prepared statement's parameters by name and type (int, str or datetime): the
    stand-ins it is compiled with, where the compiled statement took each one, and a call's
    values put in those places. A parameter the ORM transforms on the way (a `LIKE`
    pattern, say) cannot be found and is refused when the statement is compiled."""

    def __init__(self, kinds: dict[str, type]) -> None:
        self._kinds = kinds

    def sentinels(self) -> dict[str, Any]:
        sentinels: dict[str, Any] = {}
        for index, (name, kind) in enumerate(self._kinds.items()):
            if kind is int:
                sentinels[name] = _SENTINEL_INT_BASE - index
            elif kind is str:
                sentinels[name] = f"\x01prepared-parameter-{index}\x01"
            elif kind is datetime:
                sentinels[name] = _SENTINEL_EPOCH.replace(microsecond=index + 1)
            else:
                raise TypeError(f"prepared parameter {name}: int, str or datetime, not {kind}")
        return sentinels

    def slots(self, params: Sequence[Any], connection: Any) -> tuple[tuple[int, str], ...]:
        """Where each stand-in landed among a statement's compiled parameters."""
        slots: list[tuple[int, str]] = []
        for name, sentinel in self.sentinels().items():
            prepped = self._prep(name, sentinel, connection)
            positions = [i for i, param in enumerate(params) if param == prepped]
            if not positions:
                raise ValueError(f"prepared parameter {name} does not reach the SQL unchanged")
            slots.extend((position, name) for position in positions)
        return tuple(slots)

    def bind(
        self,
        params: Sequence[Any],
        slots: tuple[tuple[int, str], ...],
        values: dict[str, Any],
        connection: Any,
    ) -> list[Any]:
        """The compiled parameters with the call's values in their places."""
        bound = list(params)
        for position, name in slots:
            bound[position] = self._prep(name, values[name], connection)
        return bound

    def _prep(self, name: str, value: Any, connection: Any) -> Any:
        if self._kinds[name] is datetime:
            return _DATETIME.get_db_prep_value(value, connection)
        return value


class PreparedQuery(Generic[M]):
    """`build(**parameters)` returns the queryset; `parameters` names each one's type (int,
    str or datetime). The queryset must select model instances (no values(), no only())."""

    def __init__(self, build: Callable[..., models.QuerySet[M]], **parameters: type) -> None:
        self._build = build
        self._parameters = Parameters(parameters)
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
        params = self._parameters.bind(compiled.params, compiled.slots, values, connection)
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

    def _compile(self, alias: str) -> _Compiled:
        connection = connections[alias]
        queryset = self._build(**self._parameters.sentinels()).using(alias)
        compiler = queryset.query.get_compiler(using=alias)
        sql, params = compiler.as_sql()
        slots = self._parameters.slots(params, connection)
        klass_info = compiler.klass_info
        select = compiler.select
        assert klass_info is not None, "a prepared query selects model instances"
        select_fields = klass_info["select_fields"]
        start, end = select_fields[0], select_fields[-1] + 1
        converters = compiler.get_converters([column[0] for column in select])
        compiled = _Compiled(
            sql=sql,
            params=tuple(params),
            slots=slots,
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
        values = converted(row, compiled.converters, connection)
        instance = compiled.model.from_db(alias, compiled.init_list, values[compiled.fields])
        for populator in compiled.related:
            populator.populate(values, instance)
        for name, position in compiled.annotations.items():
            setattr(instance, name, values[position])
        return instance  # type: ignore[return-value]
