"""Payment reads."""

from __future__ import annotations

from payments.models import PaymentAttempt, Refund


def payment_attempt_latest(*, purchase_id: int) -> PaymentAttempt | None:
    return PaymentAttempt.objects.filter(purchase_id=purchase_id).order_by("-pk").first()


def refunds_for_purchase(*, purchase_id: int) -> list[Refund]:
    return list(Refund.objects.filter(purchase_id=purchase_id).order_by("pk"))


def payment_attempt_for_key(*, idempotency_record_id: int) -> PaymentAttempt | None:
    """The attempt recorded under this payment id, if its request got that far."""
    return (
        PaymentAttempt.objects.select_related("purchase")
        .filter(idempotency_record_id=idempotency_record_id)
        .first()
    )
