from django.db import migrations, models

from core.indexes import AddIndexOnline


class Migration(migrations.Migration):
    # CREATE INDEX CONCURRENTLY: the attempt table stays writable while it is indexed.
    atomic = False

    dependencies = [
        ("payments", "0011_refund_proposals"),
    ]

    operations = [
        AddIndexOnline(
            model_name="paymentattempt",
            index=models.Index(fields=["tx_hash"], name="attempt_tx_hash_scale"),
        ),
    ]
