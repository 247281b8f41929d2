from django.db import migrations, models

from core.indexes import AddIndexOnline


class Migration(migrations.Migration):
    # CREATE INDEX CONCURRENTLY: the refund table stays writable while it is indexed.
    atomic = False

    dependencies = [
        ("payments", "0014_attempt_pending_scale"),
    ]

    operations = [
        AddIndexOnline(
            model_name="refund",
            index=models.Index(fields=["created_at", "id"], name="refund_export_order"),
        ),
    ]
