from typing import Any

from django.db import migrations, models
from django.utils import timezone

from core.indexes import AddIndexOnline


def check_existing_unknown(apps: Any, schema_editor: Any) -> None:
    # Executions that ended unknown before checks existed are checked at the next sweep.
    attempts = apps.get_model("fulfillment", "ExecutionAttempt")
    attempts.objects.filter(state="unknown", next_check_at__isnull=True).update(
        next_check_at=timezone.now()
    )


class Migration(migrations.Migration):
    # CREATE INDEX CONCURRENTLY: the attempt table stays writable while it is indexed.
    atomic = False

    dependencies = [
        ("fulfillment", "0003_receipt_last_fetch_noted_at"),
    ]

    operations = [
        migrations.AddField(
            model_name="executionattempt",
            name="checks",
            field=models.PositiveIntegerField(
                default=0, help_text="Checks of the job made since the execution ended unknown."
            ),
        ),
        migrations.AddField(
            model_name="executionattempt",
            name="next_check_at",
            field=models.DateTimeField(
                blank=True, help_text="When an unknown execution's job is asked again.", null=True
            ),
        ),
        migrations.RunPython(check_existing_unknown, migrations.RunPython.noop),
        AddIndexOnline(
            model_name="executionattempt",
            index=models.Index(
                condition=models.Q(("state", "unknown")),
                fields=["next_check_at"],
                name="unknown_execution_next_check",
            ),
        ),
    ]
