"""What both payment APIs share in their answers: the headers they name and how a refusal
is recorded as a payment id's answer."""

from __future__ import annotations

from core.errors import PROBLEM_HEADERS, DomainError
from purchases.services.idempotency import StoredAnswer

# A label for a deliberate extra copy of the same input (purchases.services.duplicates).
COPY_HEADER = "Tollbooth-Copy"
# On an answer that repeats an existing purchase: that purchase's ref.
DUPLICATE_HEADER = "Tollbooth-Duplicate-Of"


def refusal_answer(error: DomainError) -> StoredAnswer:
    """A refusal as the payment id's answer: its problem+json, with its status."""
    return StoredAnswer(error.spec.status, error.as_problem(), PROBLEM_HEADERS, error.purchase)
