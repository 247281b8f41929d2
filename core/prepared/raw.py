"""Raw statements of ours returning a model's rows, worked out once per process."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models.sql import Query

from core.prepared.reads import M, converted


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
            values = converted(row, shape.converters, connection)
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
