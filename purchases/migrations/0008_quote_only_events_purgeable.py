"""Events of a quote that never became a purchase may be deleted with that quote.

A quote's own events (opened, expired) carry no purchase; once the quote has a purchase
they are the start of its story and stay append-only like the rest of the timeline.

The purge of expired unpaid quotes (reconcile.purge_expired_quotes) removes the quote and
its own events; every event on a purchase's timeline stays append-only, as before.
"""

from django.db import migrations

GUARD = """
CREATE OR REPLACE FUNCTION tollbooth_event_guard() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' AND OLD.purchase_id IS NULL AND OLD.quote_id IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM purchases_purchase p WHERE p.quote_id = OLD.quote_id) THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION '%% is append-only', TG_TABLE_NAME USING ERRCODE = 'restrict_violation';
END;
$$ LANGUAGE plpgsql;
"""


def install(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return  # SQLite (the demo) relies on Model.save() refusing updates
    schema_editor.execute(GUARD)
    schema_editor.execute(
        "DROP TRIGGER IF EXISTS purchases_event_append_only ON purchases_purchaseevent;"
    )
    schema_editor.execute(
        "CREATE TRIGGER purchases_event_append_only BEFORE UPDATE OR DELETE ON purchases_purchaseevent "
        "FOR EACH ROW EXECUTE FUNCTION tollbooth_event_guard();"
    )


def remove(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        "DROP TRIGGER IF EXISTS purchases_event_append_only ON purchases_purchaseevent;"
    )
    schema_editor.execute(
        "CREATE TRIGGER purchases_event_append_only BEFORE UPDATE OR DELETE ON purchases_purchaseevent "
        "FOR EACH ROW EXECUTE FUNCTION tollbooth_refuse_change();"
    )
    schema_editor.execute("DROP FUNCTION IF EXISTS tollbooth_event_guard();")


class Migration(migrations.Migration):
    dependencies = [("purchases", "0007_offering_max_input_bytes")]
    operations = [migrations.RunPython(install, remove)]
