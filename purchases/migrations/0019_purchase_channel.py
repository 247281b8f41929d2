"""The door a purchase came in by (x402 paid URL, REST API, MCP tool call), on its case file.

Purchases before this migration came in by the paid URL (x402) or the REST API (prepaid):
their rail says which.
"""

from django.db import migrations, models


def _backfill(apps, schema_editor):  # type: ignore[no-untyped-def]
    Purchase = apps.get_model("purchases", "Purchase")
    Purchase.objects.filter(rail="prepaid").update(channel="api")


class Migration(migrations.Migration):
    dependencies = [
        ("purchases", "0018_payment_reversed"),
    ]

    operations = [
        migrations.AddField(
            model_name="purchase",
            name="channel",
            field=models.CharField(
                choices=[("http", "x402 paid URL"), ("api", "REST API"), ("mcp", "MCP tool call")],
                default="http",
                max_length=8,
            ),
        ),
        migrations.RunPython(_backfill, migrations.RunPython.noop),
    ]
