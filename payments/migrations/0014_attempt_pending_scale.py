from django.db import migrations, models

from core.indexes import AddIndexOnline


class Migration(migrations.Migration):
    # CREATE INDEX CONCURRENTLY: the attempt table stays writable while it is indexed.
    atomic = False

    dependencies = [
        ("payments", "0013_export_batch_roles"),
    ]

    operations = [
        AddIndexOnline(
            model_name="paymentattempt",
            index=models.Index(
                condition=models.Q(("state__in", ("recorded", "settlement_pending"))),
                fields=["network", "id"],
                name="attempt_pending_scale",
            ),
        ),
    ]
