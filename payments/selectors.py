"""Payment reads."""

from __future__ import annotations

from payments.models import PaymentAttempt, Refund


def payment_attempt_latest(*, purchase_id: int) -> PaymentAttempt | None:
    return PaymentAttempt.objects.filter(purchase_id=purchase_id).order_by("-pk").first()


def refunds_for_purchase(*, purchase_id: int) -> list[Refund]:
    return list(Refund.objects.filter(purchase_id=purchase_id).order_by("pk"))
