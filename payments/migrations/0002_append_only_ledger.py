"""Ledger entries are never updated or deleted: corrections are new entries."""

from django.db import migrations


def install(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        "CREATE TRIGGER payments_ledger_append_only BEFORE UPDATE OR DELETE ON payments_ledgerentry "
        "FOR EACH ROW EXECUTE FUNCTION tollbooth_refuse_change();"
    )


def remove(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        "DROP TRIGGER IF EXISTS payments_ledger_append_only ON payments_ledgerentry;"
    )


class Migration(migrations.Migration):
    dependencies = [("payments", "0001_initial"), ("purchases", "0002_append_only_events")]
    operations = [migrations.RunPython(install, remove)]
