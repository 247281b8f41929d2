"""Fulfilment reads."""

from __future__ import annotations

from datetime import datetime

from fulfillment.models import ExecutionAttempt, Receipt, Result
from purchases.models import Purchase


def result_for_purchase(*, purchase: Purchase) -> Result | None:
    return Result.objects.filter(purchase=purchase).first()


def result_is_expired(*, result: Result, now: datetime) -> bool:
    return result.expires_at <= now


def receipt_for_purchase(*, purchase: Purchase) -> Receipt | None:
    return Receipt.objects.filter(purchase=purchase).first()


def receipt_get(*, public_id: str) -> Receipt | None:
    return Receipt.objects.select_related("purchase").filter(public_id=public_id).first()


def execution_attempts(*, purchase: Purchase) -> list[ExecutionAttempt]:
    return list(ExecutionAttempt.objects.filter(purchase=purchase).order_by("pk"))
