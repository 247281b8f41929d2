"""What the prepaid API answers a payment: 201 with the purchase's status, stored with the
debit; a duplicate is 200; a refusal its problem. Replays are the stored bytes."""

from __future__ import annotations

from datetime import datetime

from core.clock import now_or
from core.errors import DomainError
from doors.rest.answers import DUPLICATE_HEADER, recorded_answer, refusal_answer
from payments.models import PaymentAttempt
from purchases.models import Purchase
from purchases.selectors import purchase_status
from purchases.services.checkout.idempotency import StoredAnswer


class PrepaidAnswers:
    """The prepaid API's answers (purchases.services.checkout.checkout.CheckoutAnswers); each is
    rendered as (stored answer, is_replay)."""

    def __init__(self, now: datetime | None = None) -> None:
        self.now = now_or(now)

    def recorded(self, *, purchase: Purchase, attempt: PaymentAttempt) -> StoredAnswer:
        status = purchase_status(purchase=purchase, now=self.now, created_with=attempt)
        return recorded_answer(201, status, {}, purchase.ref)

    def settled(
        self, *, purchase: Purchase, attempt: PaymentAttempt | None, fresh: bool
    ) -> tuple[StoredAnswer, tuple[StoredAnswer, bool]]:
        stored = recorded_answer(
            201, purchase_status(purchase=purchase, now=self.now), {}, purchase.ref
        )
        return stored, (stored, False)

    def duplicate(self, *, purchase: Purchase) -> StoredAnswer:
        body = {**purchase_status(purchase=purchase, now=self.now), "duplicate_of": purchase.ref}
        return recorded_answer(200, body, {DUPLICATE_HEADER: purchase.ref}, purchase.ref)

    def refused(self, error: DomainError) -> StoredAnswer:
        return refusal_answer(error)

    def render(self, stored: StoredAnswer, is_replay: bool) -> tuple[StoredAnswer, bool]:
        return stored, is_replay
