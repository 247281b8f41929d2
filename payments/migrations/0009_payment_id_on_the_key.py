"""The payment id lives once, on its key: attempts link to the IdempotencyRecord instead of
copying its scope and id. Existing attempts are linked to their record (by the id, or by its
hash when the record was compacted) before the copies are dropped."""

import hashlib

import django.db.models.deletion
from django.db import migrations, models


def link_attempts(apps, schema_editor):
    attempt_model = apps.get_model("payments", "PaymentAttempt")
    record_model = apps.get_model("purchases", "IdempotencyRecord")
    for attempt in attempt_model.objects.exclude(payment_id="").iterator():
        hashed = "sha256:" + hashlib.sha256(attempt.payment_id.encode()).hexdigest()
        record = (
            record_model.objects.filter(scope=attempt.scope, key=attempt.payment_id).first()
            or record_model.objects.filter(scope=attempt.scope, key=hashed).first()
        )
        if record is not None:
            attempt_model.objects.filter(pk=attempt.pk).update(idempotency_record=record)
    # Recovery points of keys written before they existed.
    record_model.objects.filter(state="completed").update(recovery_point="finished")
    record_model.objects.filter(state="in_flight", payment_attempts__isnull=False).update(
        recovery_point="payment_recorded"
    )


class Migration(migrations.Migration):
    dependencies = [
        ("payments", "0008_resubmissions"),
        ("purchases", "0011_recovery_point"),
    ]

    operations = [
        migrations.AddField(
            model_name="paymentattempt",
            name="idempotency_record",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="payment_attempts",
                to="purchases.idempotencyrecord",
            ),
        ),
        migrations.RunPython(link_attempts, migrations.RunPython.noop),
        migrations.RemoveConstraint(
            model_name="paymentattempt",
            name="unique_attempt_payment_id_per_scope",
        ),
        migrations.RemoveField(model_name="paymentattempt", name="payment_id"),
        migrations.RemoveField(model_name="paymentattempt", name="scope"),
        migrations.AddConstraint(
            model_name="paymentattempt",
            constraint=models.UniqueConstraint(
                condition=models.Q(("idempotency_record__isnull", False)),
                fields=("idempotency_record",),
                name="one_attempt_per_payment_id",
            ),
        ),
    ]
