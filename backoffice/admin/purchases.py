"""The back office for support: purchases and their evidence, and escalations (offerings and
buyers: backoffice.admin.catalog; the other evidence: backoffice.admin.evidence).

Thin on purpose: every change goes through one service call; state fields are never
editable here (FSM fields are protected and the evidence admins are view-only).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import display_for_value, unquote
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import QuerySet
from django.forms.models import BaseInlineFormSet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone

from backoffice.admin.case_actions import case_action_view
from backoffice.admin.case_evidence import evidence_download_view
from backoffice.admin.case_file import attempt_transfer_note, case_context
from backoffice.admin.dashboard import dashboard_view
from backoffice.admin.filters import (
    AssigneeFilter,
    BuyerFilter,
    OpenEscalationFilter,
    PayerWalletFilter,
    RefundOwedFilter,
    StuckFilter,
)
from core.admin import (
    CappedCountPaginator,
    DueFirstQueue,
    ReadOnlyInline,
    ReadOnlyModelAdmin,
    amount_human,
)
from fulfillment.models import ExecutionAttempt
from payments.models import PaymentAttempt, Refund
from purchases.case_file import STAFF_RESOLUTION_CODES
from purchases.models import (
    Escalation,
    Purchase,
)
from purchases.selectors import CaseRecords, purchase_case_records, purchase_search_ids
from purchases.services.remedy.case_actions import escalations_assign_to_me
from purchases.services.remedy.remedies import escalation_resolve

admin.site.site_header = "Tollbooth back office"
admin.site.site_title = "Tollbooth back office"
admin.site.index_title = "Purchases, escalations and refunds"


# --- purchase: the timeline and every record hanging under it ----------------------------
CASE_RECORDS = "_case_records"  # the page's CaseRecords, kept on the purchase it shows


class CaseRecordsFormSet(BaseInlineFormSet):
    """An inline's rows from the case records the page read once (`CASE_RECORDS` on the
    purchase, set by PurchaseAdmin.changeform_view), not a query of its own."""

    records_field = ""

    def get_queryset(self) -> Any:
        records = getattr(self.instance, CASE_RECORDS, None)
        if records is None:
            return super().get_queryset()
        if not hasattr(self, "_queryset"):
            self._queryset = list(getattr(records, self.records_field))
        return self._queryset


def _records_formset(field: str) -> type[CaseRecordsFormSet]:
    return type(f"{field.title()}FormSet", (CaseRecordsFormSet,), {"records_field": field})


class PaymentAttemptInline(ReadOnlyInline):
    model = PaymentAttempt
    formset = _records_formset("attempts")
    ordering = ("pk",)
    fields = (
        "created_at",
        "rail",
        "payer",
        "network",
        "amount",
        "state",
        "tx_hash",
        "settlement_reference",
        "reason_code",
        "transfer_note",
    )
    readonly_fields = ("transfer_note",)

    @admin.display(description="late or duplicate transfer")
    def transfer_note(self, obj: PaymentAttempt) -> str:
        # Said on the attempt row too, not only in the header: this transfer is owed back.
        return attempt_transfer_note(obj)


class ExecutionAttemptInline(ReadOnlyInline):
    model = ExecutionAttempt
    formset = _records_formset("executions")
    ordering = ("pk",)
    fields = (
        "started_at",
        "executor",
        "worker",
        "state",
        "job_ref",
        "takeovers",
        "reason_code",
        "finished_at",
    )


class RefundInline(ReadOnlyInline):
    model = Refund
    formset = _records_formset("refunds")
    ordering = ("pk",)
    fields = (
        "created_at",
        "method",
        "amount",
        "reason_code",
        "state",
        "paid_reference",
        "paid_by",
        "paid_at",
    )


class EscalationInline(ReadOnlyInline):
    model = Escalation
    formset = _records_formset("escalations")
    ordering = ("pk",)
    fields = (
        "created_at",
        "owner",
        "reason_code",
        "state",
        "deadline_at",
        "assignee",
        "resolved_by",
        "resolution_code",
        "resolution",
        "note",
    )


@admin.register(Purchase)
class PurchaseAdmin(ReadOnlyModelAdmin):
    # Narrow on purpose: the state columns must stay visible at 1366 px.
    list_display = (
        "ref",
        "offering",
        "amount_human",
        "payment_state",
        "fulfillment_state",
        "reason_code",
        "created_at",
    )
    list_filter = (
        "payment_state",
        "fulfillment_state",
        OpenEscalationFilter,
        RefundOwedFilter,
        StuckFilter,
        BuyerFilter,
        PayerWalletFilter,
        "rail",
        "channel",
        "offering",
    )
    list_select_related = ("offering",)  # no column shows the quote or the buyer
    # At a million rows: exact, indexed look-ups (see get_search_results), no full count,
    # a bounded one (CappedCountPaginator), and no date drill-down (its year list scans
    # the whole table).
    # Exact look-ups only; purchase_search_ids runs them as one UNION of index look-ups, each
    # kind only if the role sees its field.
    search_fields = (
        "=ref",
        "=buyer__ref",
        "=payer",
        "=payment_attempts__tx_hash",
        "=payment_attempts__payer",
        "=refunds__transaction",
        "=refunds__paid_reference",
        "=refunds__payer",
    )
    search_help_text = (
        "Purchase ref, buyer ref, payment id, or any wallet or transaction hash it touched "
        "(payer, each payment, a late or duplicate transfer, a refund's pay-back or its wallet)."
    )
    show_full_result_count = False
    paginator = CappedCountPaginator
    change_form_template = "admin/purchases/purchase/change_form.html"
    readonly_fields = (
        "amount_human",
        "result_sha256",
        "result_size",
        "result_expires_at",
        "result_first_delivered_at",
        "receipt_id",
    )
    fieldsets = (
        (None, {"fields": ("ref", "quote", "offering", "buyer", "payer", "rail", "channel")}),
        ("Money", {"fields": ("amount", "amount_human", "asset", "network", "paid_at")}),
        (
            "State",
            {"fields": ("payment_state", "fulfillment_state", "reason_code")},
        ),
        (
            "Result and receipt (the body is never shown here)",
            {
                "fields": (
                    "result_sha256",
                    "result_size",
                    "result_expires_at",
                    "result_first_delivered_at",
                    "receipt_id",
                )
            },
        ),
        ("Times", {"fields": ("created_at", "updated_at")}),
    )
    # The timeline is rendered by the case file (human labels, UTC seconds), not an inline.
    inlines = (
        PaymentAttemptInline,
        ExecutionAttemptInline,
        RefundInline,
        EscalationInline,
    )

    def get_urls(self) -> list[URLPattern]:
        extra = [
            path(
                "dashboard/",
                self.admin_site.admin_view(partial(dashboard_view, self)),
                name="purchases_purchase_dashboard",
            ),
            path(
                "<path:object_id>/evidence-pack/",
                self.admin_site.admin_view(partial(evidence_download_view, self)),
                name="purchases_purchase_evidence_pack",
            ),
            path(
                "<path:object_id>/case/<str:action_name>/",
                self.admin_site.admin_view(partial(case_action_view, self)),
                name="purchases_purchase_case_action",
            ),
        ]
        return [*extra, *super().get_urls()]

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        purchase = self.get_object(request, unquote(object_id)) if object_id else None
        context = dict(extra_context or {})
        if purchase is not None:
            # Read once for the whole page: the case file, the result fields and the inlines.
            records = purchase_case_records(purchase=purchase)
            setattr(purchase, CASE_RECORDS, records)
            context.update(case_context(request, purchase, timezone.now(), records))
        return super().changeform_view(request, object_id, form_url, context)

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> Purchase | None:
        """The purchase with its quote, offering, buyer, result (without its body) and
        receipt in one query, read once per request (the change view asks twice)."""
        cache: dict[tuple[str, str | None], Purchase | None] = request.__dict__.setdefault(
            "_admin_purchases", {}
        )
        key = (object_id, from_field)
        if key not in cache:
            queryset = (
                self.get_queryset(request)
                .select_related("quote", "buyer", "result", "receipt")
                .defer("result__body")
            )
            opts = Purchase._meta
            field = opts.pk if from_field is None else opts.get_field(from_field)
            try:
                cache[key] = queryset.get(**{field.name: field.to_python(object_id)})
            except (Purchase.DoesNotExist, ValidationError, ValueError):
                cache[key] = None
        return cache[key]

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Purchase], search_term: str
    ) -> tuple[QuerySet[Purchase], bool]:
        if not search_term.strip():
            return queryset, False
        kinds = [name.lstrip("=^@") for name in self.get_search_fields(request)]
        return queryset.filter(pk__in=purchase_search_ids(term=search_term, kinds=kinds)), False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Purchase]:
        # Every page shows the offering (the list's amount column, the change page): joined,
        # not read per row (a count ignores the join, and the list joins it by primary key
        # for its 100 rows only). The change page joins the rest (get_object).
        return super().get_queryset(request).select_related("offering")

    @admin.display(description="amount (asset units)")
    def amount_human(self, obj: Purchase) -> str:
        return (
            f"{amount_human(obj.amount, obj.offering.asset_decimals)} {obj.offering.asset_symbol}"
        )

    def _records(self, obj: Purchase) -> CaseRecords:
        # Five fields read the result and receipt: from the page's case records.
        records = getattr(obj, CASE_RECORDS, None)
        if records is None:
            records = purchase_case_records(purchase=obj)
            setattr(obj, CASE_RECORDS, records)
        return records

    def _result_field(self, obj: Purchase, name: str) -> str:
        result = self._records(obj).result
        # Formatted like the model fields around it (dates localised, None as "-").
        return display_for_value(getattr(result, name, None), "-")

    @admin.display(description="result SHA-256")
    def result_sha256(self, obj: Purchase) -> str:
        return self._result_field(obj, "sha256")

    @admin.display(description="result size (bytes)")
    def result_size(self, obj: Purchase) -> str:
        return self._result_field(obj, "size")

    @admin.display(description="result kept until")
    def result_expires_at(self, obj: Purchase) -> str:
        return self._result_field(obj, "expires_at")

    @admin.display(description="result first delivered")
    def result_first_delivered_at(self, obj: Purchase) -> str:
        return self._result_field(obj, "first_delivered_at")

    @admin.display(description="receipt")
    def receipt_id(self, obj: Purchase) -> str:
        receipt = self._records(obj).receipt
        return receipt.public_id if receipt is not None else "-"


# --- escalations: resolve with a written decision --------------------------------------
class ResolveForm(forms.Form):
    code = forms.ChoiceField(label="Resolution", choices=list(STAFF_RESOLUTION_CODES.items()))
    # CharField strips, so a resolution of only spaces is as empty as none.
    resolution = forms.CharField(
        label="How was it resolved?",
        widget=forms.Textarea(attrs={"rows": 4, "cols": 80}),
        help_text="Written to the escalation and the purchase timeline.",
    )


@admin.register(Escalation)
class EscalationAdmin(DueFirstQueue, ReadOnlyModelAdmin):
    list_display = (
        "purchase",
        "owner",
        "deadline_utc",
        "is_overdue",
        "reason_code",
        "state",
        "assignee",
        "resolution_code",
    )
    list_filter = ("state", "owner", AssigneeFilter, "reason_code")
    list_select_related = ("purchase",)
    search_fields = ("=purchase__ref",)
    readonly_fields = ("is_overdue", "deadline_utc")
    fields = (
        "purchase",
        "owner",
        "reason_code",
        "details",
        "deadline_utc",
        "is_overdue",
        "note",
        "assignee",
        "assigned_by",
        "assigned_at",
        "state",
        "created_at",
        "resolved_at",
        "resolved_by",
        "resolution_code",
        "resolution",
    )
    actions = ("resolve_selected", "assign_to_me")
    change_form_template = "admin/purchases/escalation/change_form.html"
    open_state = Escalation.State.OPEN

    def has_resolve_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # The action and the page's Resolve button are one action in the role table.
        return self.role_allows_action(request, "resolve_selected")

    def get_urls(self) -> list[URLPattern]:
        resolve = path(
            "<path:object_id>/resolve/",
            self.admin_site.admin_view(self.resolve_view),
            name="purchases_escalation_resolve",
        )
        return [resolve, *super().get_urls()]

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        context = {**(extra_context or {}), "can_resolve": self.has_resolve_permission(request)}
        return super().changeform_view(request, object_id, form_url, context)

    @admin.action(description="Resolve selected escalations", permissions=["resolve"])
    def resolve_selected(
        self, request: HttpRequest, queryset: QuerySet[Escalation]
    ) -> HttpResponse | None:
        return self._resolve_page(request, queryset, is_action=True)

    def has_assign_to_me_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self.role_allows_action(request, "assign_to_me")

    @admin.action(description="Assign selected escalations to me", permissions=["assign_to_me"])
    def assign_to_me(self, request: HttpRequest, queryset: QuerySet[Escalation]) -> None:
        me = request.user.get_username()
        ids = list(queryset.values_list("pk", flat=True))
        changed = escalations_assign_to_me(escalation_ids=ids, staff=me, now=timezone.now())
        self.message_user(
            request,
            f"Assigned {changed} open escalation(s) to {me}; "
            f"{len(ids) - changed} left (resolved, or already yours).",
            messages.SUCCESS,
        )

    def resolve_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        escalation = self.get_object(request, unquote(object_id))  # None for a malformed id
        if escalation is None:
            raise Http404("no such escalation")
        if not self.has_view_permission(request, escalation):
            raise PermissionDenied
        queryset = Escalation.objects.filter(pk=escalation.pk)
        response = self._resolve_page(request, queryset, is_action=False)
        change_url = reverse("admin:purchases_escalation_change", args=[escalation.pk])
        return response or HttpResponseRedirect(change_url)

    def _resolve_page(
        self, request: HttpRequest, queryset: QuerySet[Escalation], *, is_action: bool
    ) -> HttpResponse | None:
        if not self.has_resolve_permission(request):
            raise PermissionDenied
        open_ones = list(queryset.filter(state=Escalation.State.OPEN).select_related("purchase"))
        if not open_ones:
            self.message_user(request, "Nothing to resolve: already resolved.", messages.WARNING)
            return None
        submitted = request.method == "POST" and "apply" in request.POST
        form = ResolveForm(request.POST if submitted else None)
        if submitted:
            if form.is_valid():
                count = self._resolve_all(
                    request, open_ones, form.cleaned_data["resolution"], form.cleaned_data["code"]
                )
                self.message_user(request, f"Resolved {count} escalation(s).", messages.SUCCESS)
                return None
            self.message_user(
                request, "Say how it was resolved; nothing was changed.", messages.ERROR
            )
        context = {
            **self.admin_site.each_context(request),
            "title": "Resolve escalations",
            "opts": self.opts,
            "form": form,
            "escalations": open_ones,
            "is_action": is_action,
        }
        return TemplateResponse(request, "admin/purchases/escalation/resolve.html", context)

    def _resolve_all(
        self, request: HttpRequest, escalations: list[Escalation], text: str, code: str
    ) -> int:
        username = request.user.get_username()
        resolved = 0
        for pk in sorted(e.pk for e in escalations):
            now = timezone.now()
            escalation = escalation_resolve(
                escalation=Escalation(pk=pk), by=username, resolution=text, now=now, code=code
            )
            # Someone else resolved it between the list and the lock: not ours to count.
            resolved += escalation.resolved_at == now
        return resolved
