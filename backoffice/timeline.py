"""How the timeline reads to a person: a label per event subject, evidence as key/value.

`EVENT_LABELS` is the one place a new timeline subject gets its words. A subject's label may
be refined by the event's reason code or its target state (`Label.by_reason`,
`Label.by_state`): "payment_attempt" reads "Payment recorded", "Payment settled" or
"Payment failed". tests/purchases/test_timeline_labels.py fails when the code can write a
subject that has no label here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from core.clock import utc_seconds

# Evidence keys whose integer values are unix seconds (EIP-3009 windows, block times).
UNIX_TIME_KEYS = frozenset(
    {"valid_before", "valid_after", "validBefore", "validAfter", "head_timestamp", "timestamp"}
)
# Unix seconds between 2001 and 2286: an int outside it under those keys is shown as is.
_UNIX_RANGE = (1_000_000_000, 10_000_000_000)


@dataclass(frozen=True)
class Label:
    default: str
    by_reason: dict[str, str] = field(default_factory=dict)
    by_state: dict[str, str] = field(default_factory=dict)

    def text(self, *, reason_code: str, to_state: str) -> str:
        if reason_code in self.by_reason:
            return self.by_reason[reason_code]
        return self.by_state.get(to_state, self.default)


EVENT_LABELS: dict[str, Label] = {
    "quote": Label(
        "Quote changed",
        by_state={"open": "Quote opened", "accepted": "Quote accepted", "expired": "Quote expired"},
    ),
    "purchase.payment": Label(
        "Payment state changed",
        by_reason={
            "late_settlement": "Late transfer landed after the purchase failed",
            "duplicate_settlement": "Duplicate transfer for a paid purchase",
            "late_settlement_fulfilled": "Late transfer accepted: purchase paid after all",
            "authorizations_unusable": "Failure made final (no authorization can land)",
            "settlement_reorged": "Paid transfer undone by a reorg: settling it again",
            "payment_reversed": "Delivered, payment reversed (the reorged transfer can no "
            "longer land)",
        },
        by_state={
            "paying": "Payment started",
            "settlement_pending": "Settlement pending",
            "paid": "Payment recorded as paid",
            "failed": "Payment failed",
            "void": "Failure made final",
            "reversed": "Delivered, payment reversed",
            "authorized": "Authorization verified and held while the work runs",
            "released": "Work failed: authorization released, never charged",
        },
    ),
    "purchase.fulfillment": Label(
        "Fulfilment state changed",
        by_state={
            "queued": "Work queued",
            "running": "Work started",
            "succeeded": "Work succeeded, result stored",
            "failed": "Work failed",
            "unknown": "Work outcome unknown",
        },
    ),
    "purchase.duplicate": Label("Repeated payment answered with this purchase (not charged)"),
    "payment_attempt": Label(
        "Payment attempt updated",
        by_reason={
            "chain_unavailable": "Chain unreachable during look-up",
            "settlement_reorged": "Settled transfer undone by a reorg: pending again",
            "authorization_held": "Authorization held: settled only after the work",
            "work_succeeded": "Work succeeded: held authorization sent to settle",
            "work_outcome_unknown": "Work outcome unknown: held authorization sent to settle",
            "settle_margin_reached": "Window closing: held authorization sent to settle",
            "authorization_released": "Work failed: authorization released, never charged",
        },
        by_state={
            "held": "Payment verified and held",
            "recorded": "Payment recorded",
            "settlement_pending": "Broadcast, awaiting confirmation",
            "succeeded": "Payment settled",
            "failed": "Payment attempt failed",
        },
    ),
    "payment_attempt.resubmitted": Label("Same signed authorization submitted again"),
    "payment_attempt.resubmit_refused": Label("Resubmission limit reached"),
    "payment_attempt.reorged": Label(
        "Reorg: settled transfer undone, no longer in the chain",
        by_reason={"transfer_moved": "Reorg: settled transfer moved to another block"},
    ),
    "payment_attempt.final": Label("Payment final (no reorg can undo it)"),
    "execution_attempt": Label(
        "Execution attempt updated",
        by_reason={
            "executor_retry": "Executor error, retrying",
            "lease_expired_taken_over": "Worker died; execution taken over",
            "lease_resumed_by_retry": "Execution resumed by a retry",
        },
        by_state={
            "running": "Execution claimed by a worker",
            "succeeded": "Execution succeeded",
            "failed": "Execution failed",
            "unknown": "Execution outcome unknown",
        },
    ),
    "refund": Label(
        "Refund updated",
        by_state={
            "proposed": "Refund proposed (awaiting finance)",
            "owed": "Refund owed",
            "paid": "Refund paid back",
            "declined": "Refund proposal declined",
        },
    ),
    "payout": Label(
        "Payout updated",
        by_state={
            "awaiting_approval": "Payout approved (awaiting a second approver)",
            "recorded": "Payout approved and signed (recorded before its broadcast)",
            "confirmed": "Payout confirmed final",
            "failed": "Payout failed (proven: no money moved)",
            "cancelled": "Payout cancelled",
        },
    ),
    "payout.broadcast": Label("Payout broadcast"),
    "payout.rebroadcast": Label("Payout re-sent (same signed transaction)"),
    "escalation": Label(
        "Escalation updated",
        by_state={"open": "Escalated", "resolved": "Escalation resolved"},
    ),
    "escalation.assigned": Label("Escalation assigned"),
    "refund_request": Label(
        "Refund request updated",
        by_state={
            "open": "Refund requested by the buyer",
            "approved": "Refund request approved (a refund proposed to finance)",
            "denied": "Refund request denied",
        },
    ),
    "refund_request.assigned": Label("Refund request assigned"),
    "case.settlement_rechecked": Label("Settlement re-checked by staff"),
    "case.execution_reconciled": Label("Execution reconciled by staff"),
    "case.result_redelivered": Label("Result redelivery prepared by staff"),
    # Boundary events (purchases/event_subjects.py says what each means).
    "payment_attempt.broadcast": Label("Payment broadcast (first send)"),
    "payment_attempt.dropped": Label("Broadcast dropped: not on chain, nonce unused"),
    "payment_attempt.relayer_gap_closed": Label(
        "Lost relayer transaction dealt with",
        by_reason={
            "rebroadcast": "Lost relayer transaction re-sent (it held up later settlements)",
            "gap_filled": "Lost relayer transaction's nonce filled (it can no longer execute)",
        },
    ),
    "facilitator.answered": Label(
        "Facilitator answered",
        by_reason={
            "verify": "Facilitator answered /verify",
            "settle": "Facilitator answered /settle",
        },
    ),
    "payment_id.replayed": Label("Same payment id and request again: stored answer replayed"),
    "payment_id.in_flight": Label("Payment id sent again while in flight (409, retry later)"),
    "payment_id.conflict": Label(
        "Payment id reused for another request (409 conflict; this purchase unchanged)"
    ),
    "payment_id.retention_expired": Label(
        "Payment id sent again after its retention: answered with the receipt"
    ),
    "execution_attempt.retried": Label("Executor error, retrying"),
    "execution_attempt.rechecked": Label("Unknown execution checked again"),
    "result.delivered": Label("Result delivered (first time)"),
    "result.redelivered": Label("Result fetched again"),
    "result.reaccessed": Label("Result re-accessed by wallet sign-in"),
    "result.retention_expired": Label("Result asked for after its retention (410)"),
    "receipt.fetched": Label("Receipt fetched"),
    "offering.created": Label("Offering created"),
    "offering.changed": Label(
        "Offering changed",
        by_reason={
            "terms_changed": "Offering's terms changed (new version)",
            "offering_changed": "Offering changed (terms unchanged)",
        },
    ),
    "offering.upstream_changed": Label(
        "Upstream changed",
        by_reason={
            "upstream_added": "Upstream added",
            "upstream_changed": "Upstream changed",
            "upstream_removed": "Upstream removed",
        },
    ),
    "receipt.issued": Label("Signed receipt issued"),
    "evidence.exported": Label(
        "Evidence pack exported",
        by_reason={"admin": "Evidence pack downloaded", "command": "Evidence pack exported"},
    ),
    "alert.sent": Label(
        "Alert sent",
        by_reason={"refund_owed": "Refund-owed alert sent", "escalation": "Escalation alert sent"},
    ),
    "alert.failed": Label(
        "Alert not delivered (retried)",
        by_reason={
            "refund_owed": "Refund-owed alert not delivered (retried)",
            "escalation": "Escalation alert not delivered (retried)",
        },
    ),
}


# What a waiting buyer's every poll writes: each is on record, but a run of identical ones
# reads as one row (20 rows in 50 s made a 7,588 px page, issue 33 part 5).
FOLDED_SUBJECTS = frozenset({"payment_id.replayed", "payment_id.in_flight"})
_SAME_ROW = ("subject", "label", "actor", "move", "reason_code", "evidence")


def fold_repeats(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Timeline rows with each run of consecutive identical rows of a FOLDED_SUBJECTS subject
    made one: `count` (1 for every other row), `at` the first time, `last_at` the last."""
    folded: list[dict[str, Any]] = []
    for row in rows:
        previous = folded[-1] if folded else None
        if (
            previous is not None
            and row["subject"] in FOLDED_SUBJECTS
            and all(previous[key] == row[key] for key in _SAME_ROW)
        ):
            previous["count"] += 1
            previous["last_at"] = row["at"]
            continue
        folded.append({**row, "count": 1, "last_at": row["at"]})
    return folded


def event_label(*, subject: str, reason_code: str = "", to_state: str = "") -> str:
    """The words for one timeline event; an unknown subject shows as itself, never an error."""
    label = EVENT_LABELS.get(subject)
    if label is None:
        return subject
    return label.text(reason_code=reason_code, to_state=to_state)


def evidence_items(
    evidence: dict[str, Any], *, amount: Callable[[int], str] | None = None
) -> list[tuple[str, str]]:
    """Evidence as (key, text) pairs: unix seconds as UTC times, nested dicts flattened, and
    `amount` values (atomic units) through `amount`, e.g. "0.250000 USDC (250000)"."""
    items: list[tuple[str, str]] = []
    for key, value in evidence.items():
        if isinstance(value, dict):
            items.extend((f"{key}.{k}", v) for k, v in evidence_items(value, amount=amount))
        elif key == "amount" and amount is not None and str(value).isdigit():
            items.append((key, amount(int(value))))
        elif key in UNIX_TIME_KEYS and _is_unix_seconds(value):
            seconds = int(value)
            items.append((key, f"{utc_seconds(datetime.fromtimestamp(seconds, UTC))} ({seconds})"))
        elif isinstance(value, list) and any(isinstance(v, dict) for v in value):
            # Each answer in a list of them under its index, so its keys are scoped one by one.
            nested = {str(i): v for i, v in enumerate(value)}
            items.extend((f"{key}.{k}", v) for k, v in evidence_items(nested, amount=amount))
        elif isinstance(value, list):
            items.append((key, ", ".join(str(v) for v in value)))
        else:
            items.append((key, "" if value is None else str(value)))
    return items


def _is_unix_seconds(value: Any) -> bool:
    try:
        seconds = int(value)
    except (TypeError, ValueError):
        return False
    return _UNIX_RANGE[0] <= seconds < _UNIX_RANGE[1]
