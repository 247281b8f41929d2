"""What an MCP tool call is answered: the x402 paid URL's answer (doors.x402.answers),
carried in the x402 MCP transport's shape.

- payment required: `isError`, the PaymentRequired in `structuredContent` and as JSON text;
- result: its bytes as text (JSON also as `structuredContent`), the settle response in
  `_meta["x402/payment-response"]`, the receipt as a resource link and, once the payment
  is final, signed in `_meta["tollbooth/receipt"]` (docs/receipts.md);
- pending (settlement or work): `isError` (never the result), saying so in words, with what
  is awaited, when and how to ask again, and the status URL as a resource link (doors.mcp.states);
- refusal or failure: `isError`, the problem document (code, purchase, next_action, retryable)
  and whether the buyer was charged (doors.mcp.states).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from mcp import types
from pydantic import AnyUrl

from core.errors import DomainError
from doors.mcp.states import pending_result, refusal_result
from doors.rest.answers import DUPLICATE_HEADER, RECEIPT_HEADER, sent_bytes
from doors.x402.answers import PAYMENT_RESPONSE, X402Answer
from fulfillment.receipt_signing import receipt_decode
from purchases.services.checkout.idempotency import StoredAnswer

PAYMENT_RESPONSE_META = "x402/payment-response"
PURCHASE_META = "tollbooth/purchase"
DUPLICATE_META = "tollbooth/duplicate-of"
RETRY_AFTER_META = "tollbooth/retry-after"
RECEIPT_META = "tollbooth/receipt"
_RETRY_AFTER_DEFAULT = 2  # every pending answer has Retry-After; this is only a floor


def _json_result(
    document: Any,
    *,
    is_error: bool,
    meta: dict[str, Any] | None = None,
    links: list[types.ResourceLink] | None = None,
) -> types.CallToolResult:
    text = types.TextContent(type="text", text=json.dumps(document, separators=(",", ":")))
    return types.CallToolResult(
        content=[text, *(links or [])],
        structuredContent=document if isinstance(document, dict) else None,
        isError=is_error,
        _meta=meta or None,
    )


def payment_required_result(document: dict[str, Any]) -> types.CallToolResult:
    """The x402 MCP transport's payment required: an error result carrying the offer."""
    return _json_result(document, is_error=True)


def problem_result(error: DomainError) -> types.CallToolResult:
    """A refusal before any purchase answer (bad payment, in flight, conflict, a payment id
    past retention answered from its signed receipt...)."""
    meta: dict[str, Any] = {RETRY_AFTER_META: error.retry_after} if error.retry_after else {}
    if isinstance(error.extra.get("signed_receipt"), dict):
        meta[RECEIPT_META] = error.extra["signed_receipt"]
    if error.purchase:
        meta[PURCHASE_META] = error.purchase
    return refusal_result(error.as_problem(), meta)


def _settle_response(headers: dict[str, str]) -> dict[str, Any] | None:
    encoded = headers.get(PAYMENT_RESPONSE)
    if not encoded:
        return None
    try:
        decoded = json.loads(base64.b64decode(encoded))
    except (binascii.Error, ValueError):
        return None
    return decoded if isinstance(decoded, dict) else None


def _meta(headers: dict[str, str], purchase: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    settle = _settle_response(headers)
    if settle is not None:
        meta[PAYMENT_RESPONSE_META] = settle
    if purchase:
        meta[PURCHASE_META] = purchase
    if headers.get(DUPLICATE_HEADER):
        meta[DUPLICATE_META] = headers[DUPLICATE_HEADER]
    if headers.get("Retry-After"):
        meta[RETRY_AFTER_META] = int(headers["Retry-After"])
    if headers.get(RECEIPT_HEADER):
        # The signed receipt as a JSON object (on HTTP: base64 in the header).
        meta[RECEIPT_META] = receipt_decode(headers[RECEIPT_HEADER])
    return meta


def _link(uri: str, name: str, description: str) -> types.ResourceLink:
    return types.ResourceLink(
        type="resource_link",
        uri=AnyUrl(uri),
        name=name,
        description=description,
    )


def answer_result(answer: X402Answer, *, base_url: str, tool: str) -> types.CallToolResult:
    """The paid URL's answer as a tool result of `tool` (see the module docstring)."""
    headers = dict(answer.headers)
    if answer.status == 202:
        body = answer.body
        status_url = _absolute(base_url, body["status_url"])
        meta = _meta(headers, body.get("purchase"))
        link = _link(status_url, "status", "Poll this purchase, or call the tool again.")
        return pending_result(
            {**body, "status_url": status_url},
            meta=meta,
            tool=tool,
            status_url=status_url,
            retry_after=int(headers.get("Retry-After") or _RETRY_AFTER_DEFAULT),
            links=[link],
        )
    if answer.status >= 300:
        body = answer.body
        if isinstance(body, bytes | bytearray | memoryview):
            body = json.loads(bytes(body))
        return refusal_result(body, _meta(headers, body.get("purchase")))
    return _delivered(answer, headers, base_url)


def _absolute(base_url: str, url: str) -> str:
    return base_url + url if url.startswith("/") else url


def _delivered(answer: X402Answer, headers: dict[str, str], base_url: str) -> types.CallToolResult:
    raw = bytes(answer.body)
    content_type = (answer.content_type or "application/octet-stream").split(";")[0].strip()
    structured = None
    content: list[Any]
    if content_type == "application/json" or content_type.startswith("text/"):
        text = raw.decode("utf-8", errors="replace")
        content = [types.TextContent(type="text", text=text)]
        if content_type == "application/json":
            parsed = json.loads(raw)
            structured = parsed if isinstance(parsed, dict) else None
    else:
        blob = types.BlobResourceContents(
            uri=AnyUrl("tollbooth://result"),
            mimeType=content_type,
            blob=base64.b64encode(raw).decode(),
        )
        content = [types.EmbeddedResource(type="resource", resource=blob)]
    link = headers.get("Link", "")
    if link.startswith("<"):
        receipt = _absolute(base_url, link[1 : link.index(">")])
        content.append(_link(receipt, "receipt", "The purchase's receipt."))
    return types.CallToolResult(
        content=content, structuredContent=structured, isError=False, _meta=_meta(headers, None)
    )


def prepaid_refusal_result(stored: StoredAnswer) -> types.CallToolResult:
    """A prepaid payment refused (insufficient funds, spend cap...), as stored."""
    body = json.loads(sent_bytes(stored))
    return refusal_result(body, _meta(dict(stored.headers), stored.purchase_ref))
