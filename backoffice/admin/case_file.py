"""The purchase page as a case file: what the "Now" box, the lifecycle strip and the
timeline show (templates under templates/admin/purchases/purchase/). The actions' views
are in backoffice/admin/case_actions.py.

The role table (backoffice.roles) decides this page as it decides every other: an action is
offered only when the table grants it to the role and the case makes it safe now; each
evidence item names the field (or case-file block) it shows, and an item the role does not
see is absent, so finance never gets the execution, the result's digest or the
authorization."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.apps import apps
from django.http import HttpRequest
from django.urls import reverse

from backoffice.roles import EVIDENCE_SOURCES
from backoffice.timeline import event_label, evidence_items, fold_repeats
from core.admin import RoleScoping, amount_human, role_scoping
from core.clock import utc_seconds
from payments.models import LedgerBalance, PaymentAttempt, Refund
from payments.rails.x402.networks import explorer_tx_url
from purchases.case_file import (
    ACTION_LABELS,
    Action,
    Case,
    escalated_note,
    relative,
)
from purchases.models import Escalation, Purchase, PurchaseEvent
from purchases.selectors import CaseRecords
from purchases.services.remedy import case_actions

# The case file's evidence that is no purchase field, by its name in the role table.
CASE_EVIDENCE_NAMES = frozenset(
    {
        "case_quote",
        "case_authorization",
        "case_execution",
        "case_reconciliation",
        "case_remedy",
        "case_escalations",
        "case_balance",
    }
)
# Actions that take no input: one button, one POST.
ONE_CLICK = (Action.RECHECK_SETTLEMENT, Action.RECONCILE_EXECUTION, Action.REDELIVER_RESULT)
STAGES = (
    ("quote", "Quote"),
    ("authorize", "Authorization and verification"),
    ("execute", "Execution and delivery"),
    ("settle", "Settlement"),
    ("remedy", "Remedy"),
)


def money(amount: int, purchase: Purchase) -> str:
    """'0.250000 USDC (250000)': asset units with the atomic units beside them."""
    offering = purchase.offering
    return f"{amount_human(amount, offering.asset_decimals)} {offering.asset_symbol} ({amount})"


def action_url(purchase: Purchase, action: Action) -> str:
    return reverse("admin:purchases_purchase_case_action", args=[purchase.pk, action.value])


# --- what the page shows ---------------------------------------------------------------
def case_context(
    request: HttpRequest, purchase: Purchase, now: datetime, records: CaseRecords
) -> dict[str, Any]:
    """Everything from `records` (read once for the page) and the purchase's own joins: one
    query more for the timeline, one for a buyer's balance, none per row."""
    case = case_actions.purchase_case_now(purchase=purchase, now=now, records=records)
    scoping = role_scoping(request, Purchase)
    allowed = [a for a in case.actions if scoping.may_run(a.value)]
    return {
        "case": case,
        "case_owner": case.owner.value,
        "case_notes": _notes(case, role_scoping(request, Escalation)),
        "case_deadline_utc": utc_seconds(case.deadline_at),
        "case_deadline_relative": relative(case.deadline_at, now),
        "case_changes_until_utc": utc_seconds(case.changes_until),
        "case_next_check_utc": utc_seconds(case.next_check_at),
        "case_next_check_relative": relative(case.next_check_at, now),
        "case_links": case_links(request, purchase, case),
        "case_actions": [
            {
                "name": a.value,
                "label": ACTION_LABELS[a],
                "url": action_url(purchase, a),
                "one_click": a in ONE_CLICK,
            }
            for a in allowed
        ],
        "case_strip": lifecycle_strip(purchase, records, scoping),
        "case_timeline": timeline_rows(purchase, evidence_shown(request))
        if role_scoping(request, PurchaseEvent).has_scope
        else [],
        "case_balance": prepaid_balance(purchase) if scoping.sees("case_balance") else None,
    }


def case_links(request: HttpRequest, purchase: Purchase, case: Case) -> list[dict[str, str]]:
    """Records a person opens to act, beside the actions: an owed refund, for finance on the
    owed list narrowed to this purchase (where it is marked paid back), for support on its
    page. Only for a role that sees refunds."""
    refunds = role_scoping(request, Refund)
    if not refunds.has_scope:
        return []
    links = []
    for link in case.links:
        pk = link.removeprefix("refund:")
        if refunds.may_run("mark_paid_back"):
            url = reverse("admin:payments_refund_changelist") + f"?state=owed&q={purchase.ref}"
            label = f"Pay back refund {pk} (owed), then mark it paid back"
        else:
            url = reverse("admin:payments_refund_change", args=[pk])
            label = f"Refund {pk} (owed: finance pays it back)"
        links.append({"name": f"refund-{pk}", "label": label, "url": url})
    return links


def _notes(case: Case, escalations: RoleScoping) -> list[str]:
    """The Now box's notes; an escalation's reason code only for a role that sees it."""
    if not case.escalation_reason or escalations.sees("reason_code"):
        return list(case.notes)
    full = escalated_note(case.owner, case.escalation_reason)
    return [escalated_note(case.owner) if note == full else note for note in case.notes]


def _current_stage(purchase: Purchase, records: CaseRecords) -> str:
    """Where the purchase is now: an open remedy first, then the payment, then the work."""
    open_remedy = any(e.state == Escalation.State.OPEN for e in records.escalations) or any(
        r.state in (Refund.State.PROPOSED, Refund.State.OWED) for r in records.refunds
    )
    if open_remedy:
        return "remedy"
    pay = purchase.payment_state
    if pay == Purchase.PaymentState.UNPAID:
        return "quote"
    if pay == Purchase.PaymentState.PAID:
        return "execute"
    return "settle"  # paying, pending, failed or void: the settlement decides


_SETTLEMENT_PROBLEMS = (
    Purchase.PaymentState.FAILED,
    Purchase.PaymentState.VOID,
    Purchase.PaymentState.REVERSED,  # delivered, payment undone by a reorg
)


def _stage_status(key: str, purchase: Purchase, records: CaseRecords, current: str) -> str:
    """green done, amber current, red problem, grey waiting."""
    pay, run = purchase.payment_state, purchase.fulfillment_state
    problem = {
        "settle": pay in _SETTLEMENT_PROBLEMS,
        "execute": run in (Purchase.FulfillmentState.FAILED, Purchase.FulfillmentState.UNKNOWN),
    }
    done = {
        "quote": purchase.quote.state == "accepted",
        "authorize": bool(records.attempts),
        "execute": run == Purchase.FulfillmentState.SUCCEEDED,
        "settle": pay == Purchase.PaymentState.PAID,
        "remedy": any(r.state == Refund.State.PAID for r in records.refunds)
        or any(e.state == Escalation.State.RESOLVED for e in records.escalations),
    }
    if problem.get(key):
        return "problem"
    if key == current:
        return "current"
    return "done" if done[key] else "waiting"


def lifecycle_strip(
    purchase: Purchase, records: CaseRecords, scoping: RoleScoping
) -> list[dict[str, Any]]:
    current = _current_stage(purchase, records)
    evidence = {
        "quote": _quote_evidence(purchase),
        "authorize": _authorize_evidence(purchase, records),
        "execute": _execute_evidence(purchase, records),
        "settle": _settle_evidence(purchase, records),
        "remedy": _remedy_evidence(purchase, records),
    }
    return [
        {
            "key": key,
            "title": title,
            "status": _stage_status(key, purchase, records, current),
            "is_current": key == current,
            "evidence": [i for i in evidence[key] if scoping.sees(i["field"])],
        }
        for key, title in STAGES
    ]


def _item(label: str, value: Any, url: str | None = None, *, field: str) -> dict[str, Any]:
    """One line of evidence; `field` is its name in the role table's purchase scope."""
    shown = "-" if value in (None, "") else str(value)
    return {"label": label, "value": shown, "url": url, "field": field}


def _quote_evidence(purchase: Purchase) -> list[dict[str, Any]]:
    quote = purchase.quote
    # The channel is the door it was bought through, set once; a later fetch of its status
    # or result through another door is on the timeline (each delivery names its own).
    bought_on = f"{purchase.get_channel_display()} (later fetches: see each delivery)"
    return [
        _item("bought on", bought_on, field="channel"),
        _item("quote", quote.public_id, field="case_quote"),
        _item("terms version", quote.offering_version, field="case_quote"),
        _item("price", money(quote.price, purchase), field="case_quote"),
        _item("state", quote.state, field="case_quote"),
        _item("created", utc_seconds(quote.created_at), field="case_quote"),
        _item("expires", utc_seconds(quote.expires_at), field="case_quote"),
    ]


def _attempt_note(attempt: PaymentAttempt) -> str:
    reasons = {r.reason_code for r in attempt.refunds.all()}
    if "duplicate_settlement" in reasons:
        return "duplicate transfer: refund"
    if "late_settlement" in reasons:
        return "late transfer: refund"
    return ""


def attempt_transfer_note(attempt: PaymentAttempt) -> str:
    """'late transfer: refund owed': a failed attempt whose money landed after all (or a
    second transfer for a paid purchase) is not only "failed" wherever the attempt shows."""
    reasons = {r.reason_code: r.state for r in attempt.refunds.all()}
    for reason, words in (("duplicate_settlement", "duplicate"), ("late_settlement", "late")):
        if reason in reasons:
            return f"{words} transfer: refund {reasons[reason]}"
    return "-"


def _authorize_evidence(purchase: Purchase, records: CaseRecords) -> list[dict[str, Any]]:
    items = []
    for attempt in records.attempts:
        note = _attempt_note(attempt)
        items += [
            _item(
                f"attempt {attempt.pk}",
                f"{attempt.rail} · {attempt.state}",
                field="case_authorization",
            ),
            _item("payer", attempt.payer, field="case_authorization"),
            _item("recorded", utc_seconds(attempt.created_at), field="case_authorization"),
            _item(
                "window closes", utc_seconds(attempt.valid_before_at), field="case_authorization"
            ),
        ]
        items += [_item("transfer", note, field="case_authorization")] if note else []
    return items or [_item("attempts", "none", field="case_authorization")]


def _execute_evidence(purchase: Purchase, records: CaseRecords) -> list[dict[str, Any]]:
    items = []
    for run in records.executions:
        items += [
            _item(
                f"execution {run.pk}", f"{run.state} · {run.tries} tries", field="case_execution"
            ),
            _item("job ref", run.job_ref, field="case_execution"),
            _item("started", utc_seconds(run.started_at), field="case_execution"),
            _item("finished", utc_seconds(run.finished_at), field="case_execution"),
        ]
        if run.next_check_at is not None:  # ended unknown: checked again automatically
            items += [
                _item(
                    "next check",
                    f"{utc_seconds(run.next_check_at)} · {run.checks} checks so far",
                    field="case_execution",
                )
            ]
    result = records.result
    if result is not None:
        items += [
            _item("result SHA-256", result.sha256, field="result_sha256"),
            _item("result size (bytes)", result.size, field="result_size"),
            _item("kept until", utc_seconds(result.expires_at), field="result_expires_at"),
            _item(
                "first delivered",
                utc_seconds(result.first_delivered_at),
                field="result_first_delivered_at",
            ),
        ]
    receipt = records.receipt
    items += [_item("receipt", receipt.public_id, field="receipt_id")] if receipt else []
    return items or [_item("executions", "none", field="case_execution")]


def _settle_evidence(purchase: Purchase, records: CaseRecords) -> list[dict[str, Any]]:
    items = [
        _item("amount", money(purchase.amount, purchase), field="amount"),
        _item("network", purchase.network, field="network"),
    ]
    for attempt in records.attempts:
        if attempt.tx_hash:
            link = explorer_tx_url(network=attempt.network, tx_hash=attempt.tx_hash)
            items.append(
                _item(
                    f"tx (attempt {attempt.pk})",
                    attempt.tx_hash,
                    link,
                    field="payment_attempts__tx_hash",
                )
            )
        if attempt.block_number:
            items.append(_item("block", attempt.block_number, field="payment_attempts__tx_hash"))
        if attempt.settlement_reference and attempt.settlement_reference != attempt.tx_hash:
            items.append(
                _item(
                    "settlement reference",
                    attempt.settlement_reference,
                    field="payment_attempts__tx_hash",
                )
            )
        if attempt.next_check_at and attempt.state in ("recorded", "settlement_pending"):
            items.append(
                _item(
                    "next look-up", utc_seconds(attempt.next_check_at), field="case_reconciliation"
                )
            )
    items.append(_item("paid at", utc_seconds(purchase.paid_at), field="paid_at"))
    return items


def _remedy_evidence(purchase: Purchase, records: CaseRecords) -> list[dict[str, Any]]:
    items = []
    for refund in records.refunds:
        items += [
            _item(
                f"refund {refund.pk}", f"{refund.state} · {refund.reason_code}", field="case_remedy"
            ),
            _item("amount", money(refund.amount, purchase), field="case_remedy"),
        ]
    for escalation in records.escalations:
        items += [
            _item(
                f"escalation {escalation.pk}",
                f"{escalation.state} · {escalation.reason_code}",
                field="case_escalations",
            ),
            _item("owner", escalation.owner, field="case_escalations"),
            _item("deadline", utc_seconds(escalation.deadline_at), field="case_escalations"),
        ]
    return items or [_item("remedies", "none", field="case_remedy")]


def evidence_shown(request: HttpRequest) -> Callable[[str], bool]:
    """Whether the requester sees a (flattened) evidence key: each part of its path that
    copies a record's field (backoffice.roles.EVIDENCE_SOURCES) must be a field the role sees
    on that record's page, as the role table scopes the pages themselves."""
    timeline = role_scoping(request, PurchaseEvent)
    scopings: dict[str, RoleScoping] = {}

    def sees_source(part: str) -> bool:
        source = EVIDENCE_SOURCES.get(part)
        if source is None:
            return True
        label, name = source
        if label not in scopings:
            scopings[label] = role_scoping(request, apps.get_model(label))
        return scopings[label].sees(name)

    def shown(key: str) -> bool:
        return timeline.sees("evidence") and all(sees_source(p) for p in key.split("."))

    return shown


def timeline_rows(
    purchase: Purchase, shown: Callable[[str], bool] = lambda key: True
) -> list[dict[str, Any]]:
    """Every event in order; its evidence reduced to the keys `shown` lets the role see. A
    run of a polling buyer's identical answers is one row (backoffice.timeline.fold_repeats)."""
    return fold_repeats(
        {
            "pk": event.pk,
            "label": event_label(
                subject=event.subject, reason_code=event.reason_code, to_state=event.to_state
            ),
            "subject": event.subject,
            "at": utc_seconds(event.created_at),
            "actor": _actor(event, shown),
            "move": f"{event.from_state} → {event.to_state}"
            if event.from_state and event.to_state and event.from_state != event.to_state
            else event.to_state,
            "reason_code": event.reason_code,
            "evidence": [
                (key, value)
                for key, value in evidence_items(
                    event.evidence, amount=lambda a: money(a, purchase)
                )
                if shown(key)
            ],
        }
        for event in purchase.events.order_by("created_at", "pk")
    )


def _actor(event: PurchaseEvent, shown: Callable[[str], bool]) -> str:
    """Who acted: a system actor's name is a worker, a host or a job, shown to the roles
    that see workers (the evidence key `worker`'s source); the others read "system"."""
    if not event.actor or (event.actor_type == "system" and not shown("worker")):
        return event.actor_type
    return f"{event.actor_type}: {event.actor}"


def prepaid_balance(purchase: Purchase) -> str | None:
    """The buyer's prepaid balance in the purchase's asset (None without a buyer)."""
    if purchase.buyer_id is None:
        return None
    amount = (
        LedgerBalance.objects.filter(buyer_id=purchase.buyer_id, asset=purchase.asset)
        .values_list("amount", flat=True)
        .first()
    ) or 0
    return money(amount, purchase)
