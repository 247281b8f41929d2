"""Buyers' refund requests in the back office: a queue (open first, nearest deadline first,
its owner), each request beside the case's facts, and the decision. Approving proposes the
refund to finance on the existing path; denying takes a reason code the buyer reads. Nothing
here changes a row: purchases.services.remedy.refund_requests does."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join

from core.admin import DueFirstQueue, ReadOnlyModelAdmin
from purchases.models import RefundRequest
from purchases.refund_request_selectors import refund_request_facts, refund_request_status
from purchases.services.remedy.refund_requests import (
    RefundRequestRefused,
    refund_request_approve,
    refund_request_deny,
    refund_requests_assign_to_me,
)

DECIDE = "decide_refund_request"
APPROVE, DENY = "approve", "deny"


class DecideForm(forms.Form):
    decision = forms.ChoiceField(
        choices=[
            (APPROVE, "Approve: propose the refund to finance (paid to the payer's wallet)"),
            (DENY, "Deny: the buyer reads the reason code"),
        ],
        widget=forms.RadioSelect,
    )
    denial_code = forms.ChoiceField(
        choices=[("", "-")] + [(code, f"{code}: {words}") for code, words in
                               RefundRequest.DENIAL_CODES.items()],
        required=False,
        label="Reason code (when denying)",
    )  # fmt: skip
    note = forms.CharField(widget=forms.Textarea(attrs={"rows": 3}), required=False)

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if data.get("decision") == DENY and not data.get("denial_code"):
            self.add_error("denial_code", "Choose the reason code the buyer reads.")
        return data


@admin.register(RefundRequest)
class RefundRequestAdmin(DueFirstQueue, ReadOnlyModelAdmin):
    # Narrow enough for the support laptop (1366 px): the wallet and channel are on the page.
    list_display = (
        "public_id",
        "purchase",
        "amount",
        "buyer_status",
        "assignee",
        "deadline_utc",
        "is_overdue",
    )
    list_filter = ("state", "channel")
    list_select_related = ("purchase", "refund")
    search_fields = ("=public_id", "=purchase__ref", "=requested_by")
    readonly_fields = ("case_facts", "buyer_status", "deadline_utc", "is_overdue")
    fields = (
        "public_id",
        "purchase",
        "case_facts",
        "amount",
        "asset",
        "reason",
        "channel",
        "requested_by",
        "signed_message",
        "signature",
        "state",
        "buyer_status",
        "assignee",
        "deadline_utc",
        "is_overdue",
        "created_at",
        "decided_by",
        "decided_at",
        "denial_code",
        "decision_note",
        "refund",
    )
    actions = ("assign_to_me",)
    change_form_template = "admin/purchases/refundrequest/change_form.html"
    open_state = RefundRequest.State.OPEN

    @admin.display(description="the buyer reads")
    def buyer_status(self, obj: RefundRequest) -> str:
        status, code = refund_request_status(obj)
        return f"{status} ({code})" if code else status

    @admin.display(description="the case")
    def case_facts(self, obj: RefundRequest) -> str:
        purchase_url = reverse("admin:purchases_purchase_change", args=[obj.purchase_id])
        rows = format_html_join(
            "", "<tr><th>{}</th><td>{}</td></tr>", refund_request_facts(request=obj)
        )
        return format_html(
            '<table class="refund-request-facts">{}</table><a href="{}">Open the case file</a>',
            rows,
            purchase_url,
        )

    def has_decide_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self.role_allows_action(request, DECIDE)

    def has_assign_to_me_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self.role_allows_action(request, "assign_to_me")

    @admin.action(description="Assign selected refund requests to me", permissions=["assign_to_me"])
    def assign_to_me(self, request: HttpRequest, queryset: QuerySet[RefundRequest]) -> None:
        me = request.user.get_username()
        ids = list(queryset.values_list("pk", flat=True))
        changed = refund_requests_assign_to_me(request_ids=ids, staff=me)
        self.message_user(
            request,
            f"Assigned {changed} open refund request(s) to {me}; "
            f"{len(ids) - changed} left (decided, or already yours).",
            messages.SUCCESS,
        )

    def get_urls(self) -> list[URLPattern]:
        decide = path(
            "<path:object_id>/decide/",
            self.admin_site.admin_view(self.decide_view),
            name="purchases_refundrequest_decide",
        )
        return [decide, *super().get_urls()]

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        context = {**(extra_context or {}), "can_decide": self.has_decide_permission(request)}
        return super().changeform_view(request, object_id, form_url, context)

    def decide_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        refund_request = self.get_object(request, unquote(object_id))
        if refund_request is None:
            raise Http404("no such refund request")
        if not self.has_view_permission(request, refund_request):
            raise PermissionDenied
        if not self.has_decide_permission(request):
            raise PermissionDenied
        change_url = reverse("admin:purchases_refundrequest_change", args=[refund_request.pk])
        submitted = request.method == "POST"
        form = DecideForm(request.POST if submitted else None)
        if submitted and form.is_valid():
            self._decide(request, refund_request, form.cleaned_data)
            return HttpResponseRedirect(change_url)
        context = {
            **self.admin_site.each_context(request),
            "title": f"Decide refund request {refund_request.public_id}",
            "opts": self.opts,
            "form": form,
            "refund_request": refund_request,
            "facts": refund_request_facts(request=refund_request),
        }
        return TemplateResponse(request, "admin/purchases/refundrequest/decide.html", context)

    def _decide(self, request: HttpRequest, obj: RefundRequest, data: dict[str, Any]) -> None:
        staff = request.user.get_username()
        try:
            if data["decision"] == APPROVE:
                decided = refund_request_approve(request_id=obj.pk, staff=staff, note=data["note"])
                words = (
                    f"Approved: refund {decided.refund_id} of {decided.amount} is proposed; "
                    "finance approves it and pays it to the payer's wallet."
                )
            else:
                decided = refund_request_deny(
                    request_id=obj.pk, staff=staff, code=data["denial_code"], note=data["note"]
                )
                words = f"Denied ({decided.denial_code}); the buyer reads the reason code."
        except RefundRequestRefused as refused:
            self.message_user(request, f"Nothing changed: {refused}", messages.ERROR)
            return
        self.message_user(request, words, messages.SUCCESS)
