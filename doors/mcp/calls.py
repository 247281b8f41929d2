"""One MCP tool call, synchronously (the server runs it in a worker thread): who is
calling, one domain call, its answer as a tool result.

A call paid over x402 may leave its wait for the block to the server's event loop
(doors.x402.waiting): then `tool_call` answers Waiting, with what it does after the wait
(the tool result, a refusal as a result), and the server sleeps through it (server.py).

- `_meta["x402/payment"]` present: x402_pay, exactly the x402 paid URL's flow (settle, then
  run; the same keys and duplicate window), with the MCP channel on the purchase.
- an API key on the connection (`Authorization: Bearer`, as the REST API takes it): the
  buyer's balance pays (tool_buy_prepaid); for a top-up tool the key names the balance
  credited instead, and the call is answered with the x402 offer.
- neither: the offer, a PaymentRequired naming the quote it opened (a top-up needs the key).

One more tool is free: POLL_TOOL, a purchase's status (or its result once ready) by the
reference and token a pending answer names, as the status URL answers it, for an agent
that speaks MCP only.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import close_old_connections
from mcp import types

from core.errors import DomainError, ErrorCode
from doors.mcp import refund_tool
from doors.mcp.results import (
    answer_result,
    payment_required_result,
    prepaid_refusal_result,
    problem_result,
)
from doors.mcp.states import POLL_TOOL
from doors.rest.prepaid_answers import PrepaidAnswers
from doors.x402.answers import (
    PAYMENT_RESPONSE,
    X402Answers,
    x402_answer,
    x402_capability_answer,
)
from doors.x402.waiting import Waiting, returns_wait
from purchases.models import Buyer, Purchase
from purchases.services.checkout.flow import PaymentPending
from purchases.services.shared.buyers import api_key_authenticate
from purchases.services.x402.checkout import x402_pay
from purchases.services.x402.offers import x402_offer
from purchases.services.x402.tool_checkout import tool_buy_prepaid, tool_is_top_up
from purchases.services.x402.tool_offers import ToolOffer, mcp_tool_offers

PAYMENT_META = "x402/payment"
PAYMENT_ID_META = "tollbooth/payment-id"  # optional, prepaid: the REST API's Idempotency-Key
T = TypeVar("T")
COPY_META = "tollbooth/copy"  # optional: the Tollbooth-Copy label


@dataclass(frozen=True)
class ToolCall:
    """What the transport knows about one call."""

    name: str
    arguments: dict[str, Any]
    meta: dict[str, Any]
    authorization: str | None  # the connection's Authorization header
    base_url: str  # scheme://host the client reached us at

    @property
    def endpoint_url(self) -> str:
        return f"{self.base_url}/mcp"

    @property
    def pays_over_x402(self) -> bool:
        return PAYMENT_META in self.meta


_POLL_OFFER = ToolOffer(
    name=POLL_TOOL,
    title="Purchase status (free)",
    description=(
        "Free. Where a purchase stands, or its result once ready: pass the `purchase` and "
        "`token` a pending answer gives in structuredContent.ask_again.poll.arguments."
    ),
    input_schema={
        "type": "object",
        "properties": {
            "purchase": {"type": "string", "maxLength": 64},
            "token": {"type": "string", "maxLength": 128},
        },
        "required": ["purchase", "token"],
        "additionalProperties": False,
    },
    meta={},
    accepts=[],
)


def tools_list() -> list[ToolOffer]:
    close_old_connections()
    try:
        return [*mcp_tool_offers(), _POLL_OFFER]
    finally:
        close_old_connections()


def tool_call(call: ToolCall) -> types.CallToolResult | Waiting[types.CallToolResult]:
    """Answer one tools/call. Never raises for an anticipated outcome: refusals are results.

    Answers Waiting (only under doors.x402.waiting.waits_returned): the payment's wait for
    its block, and the rest of this call (the result, or the refusal as a result)."""
    close_old_connections()
    try:
        # Nothing is held across a wait: the connection is handed back below, and the
        # rest runs with one of its own.
        return _refusals_as_results(lambda: _answer(call))
    finally:
        # Worker threads outlive the call: hand their connection back as a request would.
        close_old_connections()


def _refusals_as_results(answer: Callable[[], T]) -> T | types.CallToolResult:
    try:
        return answer()
    except DomainError as error:
        return problem_result(error)


def _buyer(authorization: str | None) -> Buyer | None:
    """Raises DomainError: not_authenticated (a key that is malformed, unknown or revoked)."""
    if not authorization:
        return None
    scheme, _, raw_key = authorization.partition(" ")
    buyer = api_key_authenticate(raw_key=raw_key.strip()) if scheme == "Bearer" else None
    if buyer is None:
        raise DomainError(ErrorCode.NOT_AUTHENTICATED, "Unknown or revoked API key.")
    return buyer


def _answer(call: ToolCall) -> types.CallToolResult | Waiting[types.CallToolResult]:
    if call.name == POLL_TOOL:  # free: a payment sent with it is never used
        return _poll(call)
    buyer = _buyer(call.authorization)
    if call.name == refund_tool.NAME:
        return refund_tool.refund_tool_result(call.arguments, buyer)
    copy = call.meta.get(COPY_META)
    payment = call.meta.get(PAYMENT_META)
    if payment is not None:
        answer = x402_pay(
            offering_slug=call.name,
            payment_header=_as_header(payment),
            buyer=buyer,
            answers=X402Answers(),
            copy_label=copy,
            channel=Purchase.Channel.MCP,
            raw_input=call.arguments,  # the purchase's input: the quote's, or refused
            returns_wait=returns_wait(),
        )
        if isinstance(answer, PaymentPending):  # the server's event loop sleeps through it
            return Waiting(
                answer,
                lambda resumed: _refusals_as_results(
                    lambda: answer_result(resumed(), base_url=call.base_url, tool=call.name)
                ),
            )
        return answer_result(answer, base_url=call.base_url, tool=call.name)
    if buyer is not None and not tool_is_top_up(name=call.name):
        return _prepaid(call, buyer, copy)
    offer = x402_offer(
        offering_slug=call.name,
        raw_input=call.arguments,
        buyer=buyer,  # a top-up's: the balance it credits (None for any other tool here)
        resource_url=call.endpoint_url,
        # Wallet sign-in is an HTTP header: the MCP door takes no proofs, so offers none.
        sign_in=False,
    )
    return payment_required_result(offer.document)


def _prepaid(call: ToolCall, buyer: Buyer, copy: str | None) -> types.CallToolResult:
    bought = tool_buy_prepaid(
        buyer=buyer,
        offering_slug=call.name,
        raw_input=call.arguments,
        payment_id=call.meta.get(PAYMENT_ID_META),
        answers=PrepaidAnswers(),
        copy_label=copy,
    )
    if bought.outcome is None:
        return prepaid_refusal_result(bought.stored)
    answer = x402_answer(bought.outcome)
    answer.headers.pop(PAYMENT_RESPONSE, None)  # nothing was settled on a chain
    return answer_result(answer, base_url=call.base_url, tool=call.name)


def _poll(call: ToolCall) -> types.CallToolResult:
    """Raises DomainError: invalid_input, purchase_not_found (a wrong token says no more)."""
    ref, token = call.arguments.get("purchase"), call.arguments.get("token")
    if not (isinstance(ref, str) and isinstance(token, str)) or len(ref) + len(token) > 192:
        raise DomainError(
            ErrorCode.INVALID_INPUT,
            "Send `purchase` and `token`, the strings of a pending answer's ask_again.poll.",
        )
    answer = x402_capability_answer(ref=ref, token=token)
    return answer_result(answer, base_url=call.base_url, tool=POLL_TOOL)


def _as_header(payment: Any) -> str:
    """The `_meta` payment, as the paid URL's PAYMENT-SIGNATURE carries it (base64 JSON);
    x402_presentation judges it exactly as it judges a header."""
    if isinstance(payment, str):  # JSON text, or already the header's base64
        is_json = payment.lstrip().startswith("{")
        return base64.b64encode(payment.encode()).decode() if is_json else payment
    return base64.b64encode(json.dumps(payment).encode()).decode()
