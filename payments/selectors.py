"""Payment reads."""

from __future__ import annotations

from django.db.models import Case, F, OuterRef, Q, Subquery, Value, When
from django.db.models.functions import Coalesce, NullIf

from payments.models import LIVE_ATTEMPT_STATES, PaymentAttempt, Refund


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


def payment_evidence_of_purchase() -> dict[str, Subquery]:
    """For annotating a purchase query (`OuterRef("pk")`): the transaction reference and the
    network of its settled attempt (the first), else of its live one (the latest). One
    query, not two: `payment_reference`, `payment_network`, `payment_mined_at`."""
    is_settled = Q(state=PaymentAttempt.State.SUCCEEDED)
    attempts = PaymentAttempt.objects.filter(
        purchase_id=OuterRef("pk"), state__in=LIVE_ATTEMPT_STATES
    ).order_by(
        Case(When(is_settled, then=Value(0)), default=Value(1)),
        Case(When(is_settled, then=F("pk")), default=-F("pk")),
    )
    reference = Coalesce(NullIf("tx_hash", Value("")), "settlement_reference")
    final = attempts.filter(is_settled, final_at__isnull=False)
    return {
        "payment_reference": Subquery(attempts.values(reference=reference)[:1]),
        "payment_network": Subquery(attempts.values("network")[:1]),
        # A settlement already final with its block time known: its receipt is signed at once.
        "payment_mined_at": Subquery(final.values("block_at")[:1]),
    }
