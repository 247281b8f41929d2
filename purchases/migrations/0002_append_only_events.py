"""The timeline is append-only in the database too, not just in Model.save()."""

from django.db import migrations

FUNCTION = """
CREATE OR REPLACE FUNCTION tollbooth_refuse_change() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION '%% is append-only', TG_TABLE_NAME USING ERRCODE = 'restrict_violation';
END;
$$ LANGUAGE plpgsql;
"""


def install(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return  # SQLite (the demo) relies on Model.save() refusing updates
    schema_editor.execute(FUNCTION)
    schema_editor.execute(
        "CREATE TRIGGER purchases_event_append_only BEFORE UPDATE OR DELETE ON purchases_purchaseevent "
        "FOR EACH ROW EXECUTE FUNCTION tollbooth_refuse_change();"
    )


def remove(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        "DROP TRIGGER IF EXISTS purchases_event_append_only ON purchases_purchaseevent;"
    )


class Migration(migrations.Migration):
    dependencies = [("purchases", "0001_initial")]
    operations = [migrations.RunPython(install, remove)]
