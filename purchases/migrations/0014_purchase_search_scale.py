from django.db import migrations, models
from django.db.models.functions import Lower

from core.indexes import AddIndexOnline


class Migration(migrations.Migration):
    # CREATE INDEX CONCURRENTLY: the purchase table stays writable while it is indexed.
    atomic = False

    dependencies = [
        ("purchases", "0013_case_file"),
    ]

    operations = [
        AddIndexOnline(
            model_name="purchase",
            index=models.Index(fields=["created_at"], name="purchase_created_at_scale"),
        ),
        AddIndexOnline(
            model_name="purchase",
            index=models.Index(Lower("payer"), name="purchase_payer_lower_scale"),
        ),
        AddIndexOnline(
            model_name="idempotencyrecord",
            index=models.Index(fields=["key"], name="idempotency_key_scale"),
        ),
    ]
