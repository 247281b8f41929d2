"""Fulfilment reads."""

from __future__ import annotations

from datetime import datetime

from django.db.models import OuterRef, QuerySet, Subquery

from core.prepared import PreparedQuery
from fulfillment.models import ExecutionAttempt, Receipt, Result


def result_for_purchase(*, purchase_id: int) -> Result | None:
    return Result.objects.filter(purchase_id=purchase_id).first()


def _result_with_receipt(purchase_id: int) -> QuerySet[Result]:
    receipt = Receipt.objects.filter(purchase_id=OuterRef("purchase_id"))
    return (
        Result.objects.filter(purchase_id=purchase_id)
        .annotate(
            receipt_public_id=Subquery(receipt.values("public_id")[:1]),
            receipt_signed=Subquery(receipt.values("signed")[:1]),
        )
        .order_by("pk")[:1]
    )


# Every delivery's read, compiled once per process (core.prepared).
_RESULT_WITH_RECEIPT = PreparedQuery(_result_with_receipt, purchase_id=int)


def result_with_receipt(*, purchase_id: int) -> Result | None:
    """The result with its receipt's public id and signed text (`receipt_public_id`,
    `receipt_signed`: empty until issued), in one query."""
    return _RESULT_WITH_RECEIPT.first(purchase_id=purchase_id)


def result_is_expired(*, result: Result, now: datetime) -> bool:
    return result.expires_at <= now


def receipt_for_purchase(*, purchase_id: int) -> Receipt | None:
    return Receipt.objects.filter(purchase_id=purchase_id).first()


def receipt_get(*, public_id: str) -> Receipt | None:
    return Receipt.objects.select_related("purchase").filter(public_id=public_id).first()


def execution_attempts(*, purchase_id: int) -> list[ExecutionAttempt]:
    return list(ExecutionAttempt.objects.filter(purchase_id=purchase_id).order_by("pk"))


def execution_next_check_at(*, purchase_id: int) -> datetime | None:
    """When the purchase's execution that ended unknown is next checked (None if none is)."""
    return (
        ExecutionAttempt.objects.filter(
            purchase_id=purchase_id, state=ExecutionAttempt.State.UNKNOWN
        )
        .order_by("-pk")
        .values_list("next_check_at", flat=True)
        .first()
    )
