"""The case file's staff actions: one view for all of them, with the forms of those that
take input. The role table first (backoffice.roles grants each case action to a role), then
the case: an action the role may not run, or the case does not offer now, answers 403 even
to a forged POST; then one call to purchases.services.remedy.case_actions."""

from __future__ import annotations

from datetime import UTC
from typing import Any

from django import forms
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone

from backoffice.admin.case_file import money
from core.clock import utc_seconds
from payments.models import Refund
from purchases.case_file import ACTION_LABELS, STAFF_RESOLUTION_CODES, Action
from purchases.models import Escalation, Purchase
from purchases.services.remedy import case_actions


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
        open_ones = list(purchase.escalations.filter(state="open").order_by("-pk"))
        # The open one (the latest, if several) first and chosen: re-assigning as offered
        # moves it, and a second escalation is a deliberate choice, never the default.
        self.set_choices(
            "escalation",
            [(e.pk, f"{e.reason_code} ({e.owner})") for e in open_ones]
            + [("", "A new escalation")],
        )
        if open_ones:
            self.fields["escalation"].initial = open_ones[0].pk


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
    code = forms.ChoiceField(label="Resolution", choices=list(STAFF_RESOLUTION_CODES.items()))
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
    # Radio buttons, not a select: each proposal's note wraps on the page, read whole.
    refund = forms.TypedChoiceField(coerce=int, widget=forms.RadioSelect)
    decision = forms.ChoiceField(choices=[("approve", "Approve"), ("decline", "Decline")])

    def __init__(self, *args: Any, purchase: Purchase, **kwargs: Any) -> None:
        super().__init__(*args, purchase=purchase, **kwargs)
        proposals = [
            (r.pk, f"{r.reason_code}: {money(r.amount, purchase)} ({r.note})")
            for r in purchase.refunds.filter(state=Refund.State.PROPOSED).order_by("pk")
        ]
        self.set_choices("refund", proposals)
        if proposals:  # ticked, as the select it replaced chose its first
            self.fields["refund"].initial = proposals[0][0]


REFUND_ACTIONS = frozenset({Action.PROPOSE_REFUND, Action.APPROVE_REFUND})
FORMS: dict[Action, type[CaseForm]] = {
    Action.ASSIGN: AssignForm,
    Action.PROPOSE_REFUND: ProposeRefundForm,
    Action.RESOLVE: ResolveCaseForm,
    Action.APPROVE_REFUND: DecideRefundForm,
}


def case_action_view(
    model_admin: Any, request: HttpRequest, object_id: str, action_name: str
) -> HttpResponse:
    """One view for every case action: the role table, then safety, then one service call."""
    try:
        action = Action(action_name)
    except ValueError as exc:
        raise PermissionDenied from exc
    purchase = model_admin.get_object(request, object_id)
    if purchase is None or not model_admin.has_view_permission(request, purchase):
        raise PermissionDenied
    if not model_admin.role_allows_action(request, action.value):
        raise PermissionDenied
    now = timezone.now()
    case = case_actions.purchase_case_now(purchase=purchase, now=now)
    if action not in case.actions:
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
        # Refunding an unknown outcome stays offered, with what it risks said before Apply.
        "warning": case.refund_warning if action in REFUND_ACTIONS else "",
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
