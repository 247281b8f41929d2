"""The MCP door's refund-request tool: the REST API's refund requests (docs/api.md) for an
agent that speaks MCP. With an API key on the connection the key's buyer asks; without
one, `signed` carries the request signed by the paying wallet (the REST body, unchanged).
With `refund_request`, it polls that request instead. The answer is the request's document
(structuredContent), a refusal the usual problem result. Its name is not a slug, so no
offering's tool can take it.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from django.conf import settings
from mcp import types

from core.errors import DomainError, ErrorCode
from core.rate_limit import Window, parse_rate, rate_limit_hit
from purchases.models import Buyer, RefundRequest
from purchases.refund_request_selectors import refund_request_document, refund_request_get
from purchases.selectors import purchase_get_for_buyer
from purchases.services.remedy.refund_requests import (
    refund_request_open,
    refund_request_open_signed,
)

NAME = "tollbooth.refund_request"
_AMOUNT = re.compile(r"[0-9]{1,30}")
INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "purchase": {"type": "string", "description": "The purchase's ref (pur_...)."},
        "refund_request": {
            "type": "string",
            "description": "Poll this request (rfr_...) instead of asking.",
        },
        "amount": {"type": "string", "description": "Atomic units (API key on the connection)."},
        "reason": {"type": "string", "maxLength": 1000},
        "idempotency_key": {"type": "string", "pattern": "^[A-Za-z0-9_-]{16,128}$"},
        "signed": {
            "type": "object",
            "description": "Without an API key: {payload, signature}, signed by the paying "
            "wallet (EIP-712, docs/api.md 'Refund requests').",
        },
    },
    "required": ["purchase"],
}


def refund_tool() -> types.Tool:
    return types.Tool(
        name=NAME,
        title="Ask for a refund, or poll a refund request",
        description="The payer of a purchase asks for its money back (all or part, once at "
        "a time); staff decide. Poll with refund_request: pending, executed (with a signed "
        "refund receipt) or denied (with a reason code).",
        inputSchema=INPUT_SCHEMA,
    )


def refund_tool_result(arguments: dict[str, Any], buyer: Buyer | None) -> types.CallToolResult:
    """The request's document as a tool result. Raises DomainError as the REST API answers."""
    document = _document(arguments, buyer)
    text = types.TextContent(type="text", text=json.dumps(document, separators=(",", ":")))
    return types.CallToolResult(content=[text], structuredContent=document, isError=False)


def _document(arguments: dict[str, Any], buyer: Buyer | None) -> dict[str, Any]:
    ref = arguments.get("purchase")
    if not isinstance(ref, str) or not ref:
        raise DomainError(ErrorCode.INVALID_REQUEST, "name the purchase")
    polled = arguments.get("refund_request")
    if polled is not None:
        found = refund_request_get(ref=ref, public_id=str(polled), buyer=buyer)
        return refund_request_document(request=found)
    _throttle(ref)
    if buyer is None:
        opened = refund_request_open_signed(ref=ref, body=arguments.get("signed"))
        return refund_request_document(request=opened.request)
    amount, reason = arguments.get("amount"), arguments.get("reason", "")
    if not isinstance(amount, str) or not _AMOUNT.fullmatch(amount) or not isinstance(reason, str):
        raise DomainError(ErrorCode.INVALID_REQUEST, "amount: atomic units as a string")
    key = arguments.get("idempotency_key")
    if not key:
        raise DomainError(ErrorCode.IDEMPOTENCY_KEY_MISSING)
    purchase = purchase_get_for_buyer(buyer=buyer, ref=ref)
    opened = refund_request_open(
        purchase_id=purchase.pk,
        channel=RefundRequest.Channel.API_KEY,
        requested_by=buyer.ref,
        amount=int(amount),
        reason=reason,
        idempotency_key=str(key),
    )
    return refund_request_document(request=opened.request)


def _throttle(ref: str) -> None:
    # The REST door's per-purchase limit (doors.rest.throttles.RefundRequestThrottle), shared.
    rate = str(settings.TOLLBOOTH["REFUND_REQUEST_RATE"])
    window = Window(f"refund_request:{ref[:64]}", *parse_rate(rate))
    decision = rate_limit_hit(windows=[window], now=time.time())
    if not decision.allowed:
        raise DomainError(ErrorCode.THROTTLED, retry_after=max(1, int(decision.wait or 1)))
