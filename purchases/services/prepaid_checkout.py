"""The prepaid API's payment: a quote paid from the buyer's balance under an
Idempotency-Key, answered 201 with the purchase's status (stored with the debit)."""

from __future__ import annotations

from datetime import datetime

from core.canonical import fingerprint
from core.clock import now_or
from core.errors import ErrorCode
from payments.models import PaymentAttempt, Rail
from payments.rails import Presentation
from purchases.models import Buyer, Purchase
from purchases.selectors import purchase_status
from purchases.services.checkout import PaymentRequest, purchase_pay
from purchases.services.duplicates import DUPLICATE_HEADER, copy_label_validate
from purchases.services.idempotency import StoredAnswer, payment_id_validate

PREPAID_SCOPE = "prepaid"
# Outcomes about the key itself are answered fresh each time, never stored as the key's answer.
UNSTORED_CODES = frozenset(
    {
        ErrorCode.PAYMENT_IN_FLIGHT,
        ErrorCode.PAYMENT_IDENTIFIER_CONFLICT,
        ErrorCode.RETENTION_EXPIRED,
    }
)


def purchase_pay_prepaid(
    *,
    buyer: Buyer,
    quote_id: str,
    payment_id: str | None,
    copy_label: str | None = None,
    now: datetime | None = None,
) -> tuple[StoredAnswer, bool]:
    """Pay a quote from the buyer's balance. Returns (answer, is_replay).

    A new key for what this buyer already bought (same offering and input, same copy label)
    inside the offering's duplicate window is answered 200 with that purchase, marked as a
    duplicate, and nothing is debited.
    Raises DomainError: idempotency_key_missing, idempotency_key_invalid, copy_label_invalid,
    payment_identifier_conflict, payment_in_flight (never stored). Every other domain
    outcome (quote_not_found, quote_expired, quote_already_paid, insufficient_funds,
    spend_cap_exceeded) is stored as the key's answer and returned.
    """
    key = payment_id_validate(key=payment_id)
    label = copy_label_validate(label=copy_label)
    request = {"quote": quote_id, "rail": "prepaid", **({"copy": label} if label else {})}
    return purchase_pay(
        request=PaymentRequest(
            presentation=Presentation(
                rail=Rail.PREPAID,
                key=key,
                payer=buyer.ref,
                fingerprint=fingerprint(request),
                quote_id=quote_id,
            ),
            scope=PREPAID_SCOPE,
            buyer=buyer,
            copy_label=label,
            offering=None,
            now=now_or(now),
            unstored=UNSTORED_CODES,
        ),
        answers=PrepaidAnswers(now_or(now)),
    )


class PrepaidAnswers:
    """201 with the purchase's status, stored with the debit; a duplicate is 200."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def recorded(self, *, purchase: Purchase, attempt: PaymentAttempt) -> StoredAnswer:
        status = purchase_status(purchase=purchase, now=self.now, created_with=attempt)
        return StoredAnswer(201, status, {}, purchase.ref)

    def settled(
        self, *, purchase: Purchase, attempt: PaymentAttempt | None, fresh: bool
    ) -> tuple[StoredAnswer, tuple[StoredAnswer, bool]]:
        stored = StoredAnswer(
            201, purchase_status(purchase=purchase, now=self.now), {}, purchase.ref
        )
        return stored, (stored, False)

    def duplicate(self, *, purchase: Purchase) -> StoredAnswer:
        body = {**purchase_status(purchase=purchase, now=self.now), "duplicate_of": purchase.ref}
        return StoredAnswer(200, body, {DUPLICATE_HEADER: purchase.ref}, purchase.ref)

    def render(self, stored: StoredAnswer, is_replay: bool) -> tuple[StoredAnswer, bool]:
        return stored, is_replay
