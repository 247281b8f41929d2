"""Index migrations that do not lock a large live table."""

from __future__ import annotations

from typing import Any

from django.db.migrations.operations import AddIndex


class AddIndexOnline(AddIndex):
    """AddIndex, built CONCURRENTLY on PostgreSQL: writes go on while a million-row table is
    indexed. Other databases (SQLite in local runs) build it the plain way. The migration
    holding it must say `atomic = False` (CONCURRENTLY cannot run inside a transaction)."""

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if schema_editor.connection.vendor != "postgresql":
            super().database_forwards(app_label, schema_editor, from_state, to_state)
            return
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            schema_editor.add_index(model, self.index, concurrently=True)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if schema_editor.connection.vendor != "postgresql":
            super().database_backwards(app_label, schema_editor, from_state, to_state)
            return
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            schema_editor.remove_index(model, self.index, concurrently=True)
