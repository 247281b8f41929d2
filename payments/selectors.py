"""Payment reads."""

from __future__ import annotations

from payments.models import PaymentAttempt, Refund
from purchases.models import Purchase


def payment_attempt_latest(*, purchase: Purchase) -> PaymentAttempt | None:
    return purchase.payment_attempts.order_by("-pk").first()


def refunds_for_purchase(*, purchase: Purchase) -> list[Refund]:
    return list(purchase.refunds.order_by("pk"))
