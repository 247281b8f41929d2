"""The purchase page as a case file: the "Now" box, the lifecycle strip, the timeline, and
the staff actions (thin views over purchases.services.case_actions).

Every action view checks the Django permission first, then the case: an action the case
does not offer now answers 403 even to a forged POST.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django import forms
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone

from core.admin import amount_human
from fulfillment import selectors as fulfillment_selectors
from payments.models import LedgerBalance, PaymentAttempt, Refund
from payments.x402.networks import explorer_tx_url
from purchases.case_file import (
    ACTION_LABELS,
    RESOLUTION_CODES,
    Action,
    relative,
)
from purchases.models import Escalation, Purchase
from purchases.services import case_actions
from purchases.timeline import event_label, evidence_items, utc_seconds

# Who may run each action (Django permissions; purchases/roles.py gives them to the groups).
ACTION_PERMISSIONS = {
    Action.RECHECK_SETTLEMENT: "purchases.act_on_purchase",
    Action.RECONCILE_EXECUTION: "purchases.act_on_purchase",
    Action.REDELIVER_RESULT: "purchases.act_on_purchase",
    Action.PROPOSE_REFUND: "purchases.act_on_purchase",
    Action.ASSIGN: "purchases.change_escalation",
    Action.RESOLVE: "purchases.change_escalation",
    Action.APPROVE_REFUND: "payments.approve_refund",
}
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
def case_context(request: HttpRequest, purchase: Purchase, now: datetime) -> dict[str, Any]:
    case = case_actions.purchase_case_now(purchase=purchase, now=now)
    allowed = [a for a in case.actions if request.user.has_perm(ACTION_PERMISSIONS[a])]
    return {
        "case": case,
        "case_owner": case.owner.value,
        "case_deadline_utc": utc_seconds(case.deadline_at),
        "case_deadline_relative": relative(case.deadline_at, now),
        "case_changes_until_utc": utc_seconds(case.changes_until),
        "case_actions": [
            {
                "name": a.value,
                "label": ACTION_LABELS[a],
                "url": action_url(purchase, a),
                "one_click": a in ONE_CLICK,
            }
            for a in allowed
        ],
        "case_strip": lifecycle_strip(purchase),
        "case_timeline": timeline_rows(purchase),
        "case_balance": prepaid_balance(purchase),
    }


def _current_stage(purchase: Purchase) -> str:
    """Where the purchase is now: an open remedy first, then the payment, then the work."""
    open_remedy = (
        purchase.escalations.filter(state=Escalation.State.OPEN).exists()
        or purchase.refunds.filter(state__in=(Refund.State.PROPOSED, Refund.State.OWED)).exists()
    )
    if open_remedy:
        return "remedy"
    pay = purchase.payment_state
    if pay == Purchase.PaymentState.UNPAID:
        return "quote"
    if pay == Purchase.PaymentState.PAID:
        return "execute"
    return "settle"  # paying, pending, failed or void: the settlement decides


def _stage_status(key: str, purchase: Purchase, current: str) -> str:
    """green done, amber current, red problem, grey waiting."""
    pay, run = purchase.payment_state, purchase.fulfillment_state
    problem = {
        "settle": pay in (Purchase.PaymentState.FAILED, Purchase.PaymentState.VOID),
        "execute": run in (Purchase.FulfillmentState.FAILED, Purchase.FulfillmentState.UNKNOWN),
    }
    done = {
        "quote": purchase.quote.state == "accepted",
        "authorize": purchase.payment_attempts.exists(),
        "execute": run == Purchase.FulfillmentState.SUCCEEDED,
        "settle": pay == Purchase.PaymentState.PAID,
        "remedy": purchase.refunds.filter(state=Refund.State.PAID).exists()
        or purchase.escalations.filter(state=Escalation.State.RESOLVED).exists(),
    }
    if problem.get(key):
        return "problem"
    if key == current:
        return "current"
    return "done" if done[key] else "waiting"


def lifecycle_strip(purchase: Purchase) -> list[dict[str, Any]]:
    current = _current_stage(purchase)
    evidence = {
        "quote": _quote_evidence(purchase),
        "authorize": _authorize_evidence(purchase),
        "execute": _execute_evidence(purchase),
        "settle": _settle_evidence(purchase),
        "remedy": _remedy_evidence(purchase),
    }
    return [
        {
            "key": key,
            "title": title,
            "status": _stage_status(key, purchase, current),
            "is_current": key == current,
            "evidence": evidence[key],
        }
        for key, title in STAGES
    ]


def _item(label: str, value: Any, url: str | None = None) -> dict[str, Any]:
    return {"label": label, "value": "-" if value in (None, "") else str(value), "url": url}


def _quote_evidence(purchase: Purchase) -> list[dict[str, Any]]:
    quote = purchase.quote
    return [
        _item("quote", quote.public_id),
        _item("terms version", quote.offering_version),
        _item("price", money(quote.price, purchase)),
        _item("state", quote.state),
        _item("created", utc_seconds(quote.created_at)),
        _item("expires", utc_seconds(quote.expires_at)),
    ]


def _attempt_note(attempt: PaymentAttempt) -> str:
    reasons = {r.reason_code for r in attempt.refunds.all()}
    if "duplicate_settlement" in reasons:
        return "duplicate transfer: refund"
    if "late_settlement" in reasons:
        return "late transfer: refund"
    return ""


def _authorize_evidence(purchase: Purchase) -> list[dict[str, Any]]:
    items = []
    for attempt in purchase.payment_attempts.order_by("pk").prefetch_related("refunds"):
        note = _attempt_note(attempt)
        items += [
            _item(f"attempt {attempt.pk}", f"{attempt.rail} · {attempt.state}"),
            _item("payer", attempt.payer),
            _item("recorded", utc_seconds(attempt.created_at)),
            _item("window closes", utc_seconds(attempt.valid_before_at)),
        ]
        items += [_item("transfer", note)] if note else []
    return items or [_item("attempts", "none")]


def _execute_evidence(purchase: Purchase) -> list[dict[str, Any]]:
    items = []
    for run in fulfillment_selectors.execution_attempts(purchase_id=purchase.pk):
        items += [
            _item(f"execution {run.pk}", f"{run.state} · {run.tries} tries"),
            _item("job ref", run.job_ref),
            _item("started", utc_seconds(run.started_at)),
            _item("finished", utc_seconds(run.finished_at)),
        ]
    result = fulfillment_selectors.result_for_purchase(purchase_id=purchase.pk)
    if result is not None:
        items += [
            _item("result SHA-256", result.sha256),
            _item("result size (bytes)", result.size),
            _item("kept until", utc_seconds(result.expires_at)),
            _item("first delivered", utc_seconds(result.first_delivered_at)),
        ]
    receipt = fulfillment_selectors.receipt_for_purchase(purchase_id=purchase.pk)
    items += [_item("receipt", receipt.public_id)] if receipt else []
    return items or [_item("executions", "none")]


def _settle_evidence(purchase: Purchase) -> list[dict[str, Any]]:
    items = [_item("amount", money(purchase.amount, purchase)), _item("network", purchase.network)]
    for attempt in purchase.payment_attempts.order_by("pk"):
        if attempt.tx_hash:
            link = explorer_tx_url(network=attempt.network, tx_hash=attempt.tx_hash)
            items.append(_item(f"tx (attempt {attempt.pk})", attempt.tx_hash, link))
        if attempt.block_number:
            items.append(_item("block", attempt.block_number))
        if attempt.settlement_reference and attempt.settlement_reference != attempt.tx_hash:
            items.append(_item("settlement reference", attempt.settlement_reference))
        if attempt.next_check_at and attempt.state in ("recorded", "settlement_pending"):
            items.append(_item("next look-up", utc_seconds(attempt.next_check_at)))
    items.append(_item("paid at", utc_seconds(purchase.paid_at)))
    return items


def _remedy_evidence(purchase: Purchase) -> list[dict[str, Any]]:
    items = []
    for refund in purchase.refunds.order_by("pk"):
        items += [
            _item(f"refund {refund.pk}", f"{refund.state} · {refund.reason_code}"),
            _item("amount", money(refund.amount, purchase)),
        ]
    for escalation in purchase.escalations.order_by("pk"):
        items += [
            _item(f"escalation {escalation.pk}", f"{escalation.state} · {escalation.reason_code}"),
            _item("owner", escalation.owner),
            _item("deadline", utc_seconds(escalation.deadline_at)),
        ]
    return items or [_item("remedies", "none")]


def timeline_rows(purchase: Purchase) -> list[dict[str, Any]]:
    return [
        {
            "pk": event.pk,
            "label": event_label(
                subject=event.subject, reason_code=event.reason_code, to_state=event.to_state
            ),
            "subject": event.subject,
            "at": utc_seconds(event.created_at),
            "actor": f"{event.actor_type}: {event.actor}" if event.actor else event.actor_type,
            "move": f"{event.from_state} → {event.to_state}"
            if event.from_state and event.to_state and event.from_state != event.to_state
            else event.to_state,
            "reason_code": event.reason_code,
            "evidence": evidence_items(event.evidence),
        }
        for event in purchase.events.order_by("created_at", "pk")
    ]


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


# --- the action views -----------------------------------------------------------------
class CaseForm(forms.Form):
    """A case action's form; it knows its purchase (for choices among its records)."""

    def __init__(self, *args: Any, purchase: Purchase, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.purchase = purchase

    def set_choices(self, name: str, choices: list[tuple[Any, str]]) -> None:
        field = self.fields[name]
        assert isinstance(field, forms.ChoiceField)
        field.choices = choices


class AssignForm(CaseForm):
    owner = forms.ChoiceField(choices=Escalation.OwnerRole.choices)
    deadline_at = forms.DateTimeField(
        label="Deadline (UTC)",
        help_text="e.g. 2026-12-01 18:00:00",
        input_formats=["%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M"],
    )
    note = forms.CharField(widget=forms.Textarea(attrs={"rows": 3, "cols": 70}))
    escalation = forms.TypedChoiceField(coerce=int, required=False, empty_value=None)

    def __init__(self, *args: Any, purchase: Purchase, **kwargs: Any) -> None:
        super().__init__(*args, purchase=purchase, **kwargs)
        open_ones = purchase.escalations.filter(state="open").order_by("pk")
        self.set_choices(
            "escalation",
            [("", "A new escalation")]
            + [(e.pk, f"{e.reason_code} ({e.owner})") for e in open_ones],
        )


class ProposeRefundForm(CaseForm):
    kind = forms.ChoiceField(
        choices=[("refund", "Refund the whole payment"), ("compensation", "Compensation")]
    )
    amount = forms.DecimalField(
        required=False, min_value=0, help_text="Compensation only: in asset units (e.g. 0.10)."
    )
    note = forms.CharField(widget=forms.Textarea(attrs={"rows": 3, "cols": 70}))


class ResolveCaseForm(CaseForm):
    escalation = forms.TypedChoiceField(coerce=int)
    code = forms.ChoiceField(label="Resolution", choices=list(RESOLUTION_CODES.items()))
    note = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 3, "cols": 70}))

    def __init__(self, *args: Any, purchase: Purchase, **kwargs: Any) -> None:
        super().__init__(*args, purchase=purchase, **kwargs)
        self.set_choices(
            "escalation",
            [
                (e.pk, f"{e.reason_code} ({e.owner}, due {utc_seconds(e.deadline_at)})")
                for e in purchase.escalations.filter(state="open").order_by("pk")
            ],
        )


class DecideRefundForm(CaseForm):
    refund = forms.TypedChoiceField(coerce=int)
    decision = forms.ChoiceField(choices=[("approve", "Approve"), ("decline", "Decline")])

    def __init__(self, *args: Any, purchase: Purchase, **kwargs: Any) -> None:
        super().__init__(*args, purchase=purchase, **kwargs)
        self.set_choices(
            "refund",
            [
                (r.pk, f"{r.reason_code}: {money(r.amount, purchase)} ({r.note})")
                for r in purchase.refunds.filter(state=Refund.State.PROPOSED).order_by("pk")
            ],
        )


FORMS: dict[Action, type[CaseForm]] = {
    Action.ASSIGN: AssignForm,
    Action.PROPOSE_REFUND: ProposeRefundForm,
    Action.RESOLVE: ResolveCaseForm,
    Action.APPROVE_REFUND: DecideRefundForm,
}


def case_action_view(
    model_admin: Any, request: HttpRequest, object_id: str, action_name: str
) -> HttpResponse:
    """One view for every case action: permission, then safety, then one service call."""
    try:
        action = Action(action_name)
    except ValueError as exc:
        raise PermissionDenied from exc
    purchase = model_admin.get_object(request, object_id)
    if purchase is None or not model_admin.has_view_permission(request, purchase):
        raise PermissionDenied
    if not request.user.has_perm(ACTION_PERMISSIONS[action]):
        raise PermissionDenied
    now = timezone.now()
    if action not in case_actions.purchase_case_now(purchase=purchase, now=now).actions:
        raise PermissionDenied
    change_url = reverse("admin:purchases_purchase_change", args=[purchase.pk])
    form_class = FORMS.get(action)
    if form_class is None:
        if request.method != "POST":
            return HttpResponseRedirect(change_url)
        return _run(model_admin, request, change_url, lambda: _one_click(action, purchase, request))
    submitted = request.method == "POST"
    form = form_class(request.POST if submitted else None, purchase=purchase)
    if submitted and form.is_valid():
        data = form.cleaned_data
        return _run(
            model_admin, request, change_url, lambda: _with_form(action, purchase, request, data)
        )
    context = {
        **model_admin.admin_site.each_context(request),
        "title": f"{ACTION_LABELS[action]}: {purchase.ref}",
        "opts": model_admin.opts,
        "original": purchase,
        "form": form,
        "action": action.value,
        "change_url": change_url,
    }
    return TemplateResponse(request, "admin/purchases/purchase/case_action.html", context)


def _run(model_admin: Any, request: HttpRequest, change_url: str, call: Any) -> HttpResponse:
    try:
        message = call()
    except case_actions.ActionNotSafe as exc:
        raise PermissionDenied(str(exc)) from exc
    model_admin.message_user(request, message, messages.SUCCESS)
    return HttpResponseRedirect(change_url)


def _one_click(action: Action, purchase: Purchase, request: HttpRequest) -> str:
    staff = request.user.get_username()
    run = {
        Action.RECHECK_SETTLEMENT: case_actions.case_settlement_recheck,
        Action.RECONCILE_EXECUTION: case_actions.case_execution_reconcile,
        Action.REDELIVER_RESULT: case_actions.case_result_redeliver,
    }[action]
    return run(purchase_id=purchase.pk, staff=staff).message


def _with_form(action: Action, purchase: Purchase, request: HttpRequest, data: dict) -> str:
    staff = request.user.get_username()
    if action == Action.ASSIGN:
        deadline = data["deadline_at"]
        if timezone.is_naive(deadline):
            deadline = timezone.make_aware(deadline, UTC)
        escalation = case_actions.case_assign(
            purchase_id=purchase.pk,
            staff=staff,
            owner=data["owner"],
            deadline_at=deadline,
            note=data["note"],
            escalation_id=data["escalation"],
        )
        return f"Assigned to {escalation.owner} until {utc_seconds(escalation.deadline_at)}."
    if action == Action.PROPOSE_REFUND:
        decimals = purchase.offering.asset_decimals
        amount = data["amount"]
        atomic = int(amount.scaleb(decimals)) if amount is not None else None
        return case_actions.case_refund_propose(
            purchase_id=purchase.pk,
            staff=staff,
            kind=data["kind"],
            note=data["note"],
            amount=atomic,
        ).message
    if action == Action.RESOLVE:
        case_actions.case_resolve(
            escalation_id=data["escalation"], staff=staff, code=data["code"], note=data["note"]
        )
        return "Escalation resolved."
    return case_actions.case_refund_decide(
        refund_id=data["refund"], approve=data["decision"] == "approve", staff=staff
    ).message
