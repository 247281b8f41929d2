"""What a paid tool call that gave no result tells its agent: pending (what is awaited, when to
ask again, how) or refused/failed (and whether the buyer was charged), in a shape no agent can
take for the result.

Both are `isError: true` tool results with no `accepts`: the official `x402.mcp` client hands
`isError: false` to its caller as the result, and pays only for an error that carries a
PaymentRequired, so neither shape is read as a result nor paid again. `content[0]` says it
plainly ("Not the result yet", "You were not charged"); `content[1]` is the JSON of
`structuredContent` (MCP's advice for clients that read text only). docs/mcp.md, "tools/call".
"""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal
from typing import Any

from mcp import types

from core.clock import now_or
from purchases.selectors import purchase_capability_token, purchase_status_of

# The free tool any MCP agent polls a purchase with (doors.mcp.calls): a name no offering's
# slug can take (slugs have no dot).
POLL_TOOL = "tollbooth.purchase_status"

# A purchase's payment is not settled either way yet (purchases.models.Purchase.PaymentState).
_SETTLING = ("paying", "settlement_pending")
# The codes that end a purchase (the others refuse one call; docs/errors.md).
_FAILED = ("execution_failed", "payment_failed", "payment_reversed")
_CHARGED = {"charged": True, "refund_owed": True, "refunded": True, "under_review": True}


def charge_of(status: dict[str, Any] | None) -> str:
    """Whether the buyer was charged, from the purchase's status document (None: no purchase):
    not_charged, settling, charged, refund_owed, refunded or under_review (support decides)."""
    if status is None:
        return "not_charged"
    refunds = status["remedy"]["refunds"]
    payment = status["payment"]["state"]
    if payment in _SETTLING:
        return "settling"
    if payment != "paid" and not refunds:  # a late landing is refunded: then it was charged
        return "not_charged"
    if any(refund["state"] == "owed" for refund in refunds):
        return "refund_owed"
    if refunds:
        return "refunded"
    return "under_review" if status["remedy"]["state"] == "escalated" else "charged"


def _charged(charge: str) -> bool | None:
    return None if charge == "settling" else _CHARGED.get(charge, False)


def _charge_sentence(charge: str, status: dict[str, Any] | None) -> str:
    if status is None or charge == "not_charged":
        return "You were not charged for this call."
    if charge == "settling":
        return "Whether you are charged is not settled yet: the payment's confirmation is awaited."
    paid = f"You were charged {status['amount']} (atomic units of {status['asset']})"
    refunded = sum((Decimal(r["amount"]) for r in status["remedy"]["refunds"]), Decimal(0))
    return {
        "refund_owed": f"{paid}; a refund of {refunded} is owed to you: the seller pays it back.",
        "refunded": f"{paid}, and {refunded} of it was refunded.",
        "under_review": f"{paid}; support is reviewing this purchase and decides the remedy.",
    }.get(charge, f"{paid}.")


def _result(
    sentence: str, document: dict[str, Any], meta: dict[str, Any], links: list[Any]
) -> types.CallToolResult:
    return types.CallToolResult(
        content=[
            types.TextContent(type="text", text=sentence),
            types.TextContent(type="text", text=json.dumps(document, separators=(",", ":"))),
            *links,
        ],
        structuredContent=document,
        isError=True,
        _meta=meta or None,
    )


def refusal_result(problem: dict[str, Any], meta: dict[str, Any]) -> types.CallToolResult:
    """A refusal or a definitive failure (a problem document, docs/errors.md), saying whether
    the buyer was charged: read now from the purchase it names, never from the stored answer
    (a failed payment that lands late is owed back)."""
    ref = problem.get("purchase")
    status = purchase_status_of(ref=ref, now=now_or(None)) if ref else None
    charge = charge_of(status)
    code = problem.get("code", "")
    state = "failed" if code in _FAILED else "refused"
    document = {**problem, "state": state, "is_result": False, "charge": charge}
    document["charged"] = _charged(charge)
    detail = f": {problem['detail']}" if problem.get("detail") else ""
    about = f" Purchase {ref}." if ref else ""
    move = f" Next: {problem.get('next_action')} ({problem.get('owner')})."
    sentence = f"{state.capitalize()}: {code}{detail}{about} {_charge_sentence(charge, status)}"
    if code == "payment_failed" and charge == "not_charged":
        # Whoever holds a signed authorization may broadcast it until it lapses.
        sentence += " If your signed authorization still lands before it lapses, it is owed back."
    return _result(sentence + move, document, meta, [])


def pending_result(
    status: dict[str, Any],
    *,
    meta: dict[str, Any],
    tool: str,
    status_url: str,
    retry_after: int,
    links: list[Any],
) -> types.CallToolResult:
    """Paid or paying, and no result yet: what is awaited, when and how to ask again."""
    charge = charge_of(status)
    execution = status.get("execution") or {}
    settlement = status.get("settlement") or {}
    transaction = status.get("transaction") or settlement.get("transaction")
    # A flow that runs the work before taking the money (issue 34, part 1) is pending and
    # not charged yet: say which.
    paid = "you are charged" if _charged(charge) else "your payment is not taken yet"
    if charge == "settling":
        awaiting = "settlement"
        situation = (
            f"your payment (transaction {transaction}) is broadcast and its confirmation on "
            f"{status['network']} is awaited; nothing has run yet and nothing runs before it."
        )
    elif execution.get("state") == "unknown":
        awaiting = "executor"
        situation = (
            f"{paid}; the work's outcome is not known yet (it has not failed): the "
            f"seller asks its executor again at {execution.get('next_check_at')}."
        )
    else:
        awaiting = "work"
        situation = f"{paid}; the work is {execution.get('state', 'pending')}."
    ask_at = (
        execution.get("next_check_at")
        or (now_or(None) + timedelta(seconds=retry_after)).isoformat()
    )
    ref = status["purchase"]
    poll = {"purchase": ref, "token": purchase_capability_token(ref=ref)}
    document = {
        "state": "pending",
        "is_result": False,
        "purchase": status["purchase"],
        "awaiting": awaiting,
        "charge": charge,
        "charged": _charged(charge),
        "transaction": transaction,
        "network": status.get("network"),
        "retry_after_seconds": retry_after,
        "ask_again_at": ask_at,
        "ask_again": {
            "poll": {"tool": POLL_TOOL, "arguments": poll},
            "tool": tool,
            "same_arguments": True,
            "status_url": status_url,
        },
        "status": status,
    }
    how = f"call {POLL_TOOL} with {json.dumps(poll)} (free)"
    if tool != POLL_TOOL:
        how += f", or {tool} again with the same arguments (never charged twice)"
    sentence = (
        f"Not the result yet. Purchase {ref}: {situation} Ask again in {retry_after} s "
        f"(at {ask_at}): {how}, or GET {status_url}."
    )
    return _result(sentence, document, meta, links)
