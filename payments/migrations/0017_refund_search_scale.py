from django.db import migrations, models
from django.db.models.functions import Lower

from core.indexes import AddIndexOnline


class Migration(migrations.Migration):
    # CREATE INDEX CONCURRENTLY: the tables stay writable while it is indexed.
    atomic = False

    dependencies = [
        ("payments", "0016_attempt_relayer_nonce"),
    ]

    operations = [
        AddIndexOnline(
            model_name="refund",
            index=models.Index(fields=["transaction"], name="refund_transaction_scale"),
        ),
        AddIndexOnline(
            model_name="refund",
            index=models.Index(Lower("paid_reference"), name="refund_paid_reference_lower"),
        ),
        AddIndexOnline(
            model_name="refund",
            index=models.Index(fields=["payer"], name="refund_payer_scale"),
        ),
    ]
