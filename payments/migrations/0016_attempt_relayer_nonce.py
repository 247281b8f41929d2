from django.db import migrations, models

from core.indexes import AddIndexOnline


class Migration(migrations.Migration):
    # CREATE INDEX CONCURRENTLY: the attempt table stays writable while it is indexed.
    atomic = False

    dependencies = [
        ("payments", "0015_refund_export_order"),
    ]

    operations = [
        AddIndexOnline(
            model_name="paymentattempt",
            index=models.Index(
                condition=models.Q(("relayer_nonce__isnull", False)),
                fields=["network", "relayer_nonce"],
                name="attempt_relayer_nonce",
            ),
        ),
    ]
