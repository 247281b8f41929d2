"""What every app's `sql.py` writes its hand statements with: the database they run on, and
table and column names taken from the models' `_meta` (docs/architecture.md, "Where the
SQL lives"). One definition, so the apps' statements and their twins agree on both."""

from __future__ import annotations

from django.db import connection, models


def on_postgresql() -> bool:
    """Whether a statement runs in its one-statement (PostgreSQL) form; else its SQLite twin."""
    return connection.vendor == "postgresql"


def table(model: type[models.Model]) -> str:
    """A model's table, quoted."""
    return connection.ops.quote_name(model._meta.db_table)


def column(model: type[models.Model], field_name: str) -> str:
    """A model field's column, quoted."""
    field = model._meta.get_field(field_name)
    assert isinstance(field, models.Field)
    return connection.ops.quote_name(str(field.column))
