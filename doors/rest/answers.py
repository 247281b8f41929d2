"""What both payment APIs share in their answers: the headers they name and how a refusal
is recorded as a payment id's answer."""

from __future__ import annotations

import json
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

from core.errors import PROBLEM_HEADERS, DomainError
from fulfillment.receipt_signing import receipt_header_value
from purchases.services.checkout.idempotency import StoredAnswer

# A label for a deliberate extra copy of the same input (purchases.services.checkout.duplicates).
COPY_HEADER = "Tollbooth-Copy"
# On an answer that repeats an existing purchase: that purchase's ref.
DUPLICATE_HEADER = "Tollbooth-Duplicate-Of"
# The signed receipt (docs/receipts.md): base64 of its JSON text, on every paid answer once
# the payment is final.
RECEIPT_HEADER = "Tollbooth-Receipt"


def receipt_headers(signed: str) -> dict[str, str]:
    """The receipt header for a signed receipt's text; none before it is issued."""
    return {RECEIPT_HEADER: receipt_header_value(signed)} if signed else {}


def receipt_headers_of(extra: dict[str, Any]) -> dict[str, str]:
    """The receipt header for a refusal carrying the signed receipt (`signed_receipt`)."""
    document = extra.get("signed_receipt")
    if not isinstance(document, dict):
        return {}
    return receipt_headers(json.dumps(document, separators=(",", ":")))


def recorded_answer(
    status: int,
    body: Any,
    headers: dict[str, str],
    purchase_ref: str | None,
    *,
    is_live: bool = False,
) -> StoredAnswer:
    """An answer to record as a payment id's, its JSON body's bytes fixed now: every replay
    sends exactly these, whatever jsonb does to key order."""
    return StoredAnswer(status, body, headers, purchase_ref, is_live=is_live, raw=_encoded(body))


def sent_bytes(stored: StoredAnswer) -> bytes:
    """The body a stored answer sends: the bytes recorded with it (a record from before
    those were kept has only its document, encoded as it was then)."""
    if stored.raw is not None:
        return stored.raw
    return _encoded(stored.body) or b""


def _encoded(body: Any) -> bytes | None:
    if body is None:
        return None
    return json.dumps(body, cls=DjangoJSONEncoder, ensure_ascii=False).encode()


def refusal_answer(error: DomainError) -> StoredAnswer:
    """A refusal as the payment id's answer: its problem+json, with its status."""
    return recorded_answer(error.spec.status, error.as_problem(), PROBLEM_HEADERS, error.purchase)
