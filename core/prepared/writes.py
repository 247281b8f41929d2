"""`PreparedUpdate`: a queryset's update() of a fixed shape, compiled once per process.

A model's own saves (an FSM transition's conditional UPDATE, a new row's INSERT) go through
Django and django-fsm unchanged: overriding their private `_do_update` / `_do_insert` saved
a few milliseconds per paid request and would break first on an upgrade (issue 20).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, models, transaction
from django.db.models.sql import UpdateQuery

from core.prepared.reads import Parameters


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
