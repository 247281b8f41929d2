"""The back office for support: purchases and their evidence, escalations, offerings, buyers.

Thin on purpose: every change goes through one service call; state fields are never
editable here (FSM fields are protected and the evidence admins are view-only).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.utils import display_for_value, unquote
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Case, IntegerField, QuerySet, Value, When
from django.db.models.expressions import OrderBy
from django.forms.models import BaseInlineFormSet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone

from core.admin import (
    CappedCountPaginator,
    ReadOnlyInline,
    ReadOnlyModelAdmin,
    RoleScopedAdmin,
    amount_human,
)
from fulfillment.models import ExecutionAttempt
from payments.models import LedgerBalance, PaymentAttempt, Refund
from purchases.admin.case_actions import case_action_view
from purchases.admin.case_file import case_context
from purchases.admin.dashboard import dashboard_view
from purchases.admin.filters import (
    BuyerFilter,
    OpenEscalationFilter,
    PayerWalletFilter,
    RefundOwedFilter,
    StuckFilter,
)
from purchases.case_file import RESOLUTION_CODES
from purchases.models import (
    ApiKey,
    Buyer,
    BuyerWallet,
    Escalation,
    IdempotencyRecord,
    JobRun,
    Offering,
    Purchase,
    Quote,
)
from purchases.selectors import CaseRecords, purchase_case_records, purchase_search_ids
from purchases.services.buyers import (
    api_key_issue,
    buyer_create,
    buyer_wallet_add,
    buyer_wallet_remove,
)
from purchases.services.offerings import offering_update
from purchases.services.remedies import escalation_resolve
from purchases.timeline import utc_seconds

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
        reasons = {r.reason_code: r.state for r in obj.refunds.all()}
        for reason, words in (("duplicate_settlement", "duplicate"), ("late_settlement", "late")):
            if reason in reasons:
                return f"{words} transfer: refund {reasons[reason]}"
        return "-"


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
        "offering",
    )
    list_select_related = ("offering",)  # no column shows the quote or the buyer
    # At a million rows: exact, indexed look-ups (see get_search_results), no full count,
    # a bounded one (CappedCountPaginator), and no date drill-down (its year list scans
    # the whole table).
    # Exact look-ups only; purchase_search_ids runs them as one UNION of index look-ups, each
    # kind only if the role sees its field.
    search_fields = ("=ref", "=buyer__ref", "=payer", "=payment_attempts__tx_hash")
    search_help_text = "Purchase ref, buyer ref, payment id, payer wallet or transaction hash."
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
        (None, {"fields": ("ref", "quote", "offering", "buyer", "payer", "rail")}),
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
    code = forms.ChoiceField(label="Resolution", choices=list(RESOLUTION_CODES.items()))
    # CharField strips, so a resolution of only spaces is as empty as none.
    resolution = forms.CharField(
        label="How was it resolved?",
        widget=forms.Textarea(attrs={"rows": 4, "cols": 80}),
        help_text="Written to the escalation and the purchase timeline.",
    )


@admin.register(Escalation)
class EscalationAdmin(ReadOnlyModelAdmin):
    list_display = (
        "purchase",
        "owner",
        "deadline_utc",
        "is_overdue",
        "reason_code",
        "state",
        "assigned_by",
        "resolution_code",
    )
    list_filter = ("state", "owner", "reason_code")
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
        "assigned_by",
        "assigned_at",
        "state",
        "created_at",
        "resolved_at",
        "resolved_by",
        "resolution_code",
        "resolution",
    )
    actions = ("resolve_selected",)
    change_form_template = "admin/purchases/escalation/change_form.html"

    def get_ordering(self, request: HttpRequest) -> list[Any]:
        # Open first, then the nearest deadline: the top of the list is what is due next.
        is_resolved = Case(
            When(state=Escalation.State.OPEN, then=Value(0)),
            default=Value(1),
            output_field=IntegerField(),
        )
        return [OrderBy(is_resolved), "deadline_at", "pk"]

    @admin.display(description="deadline (UTC)", ordering="deadline_at")
    def deadline_utc(self, obj: Escalation) -> str:
        return utc_seconds(obj.deadline_at)

    @admin.display(boolean=True, description="overdue")
    def is_overdue(self, obj: Escalation) -> bool:
        return obj.state == Escalation.State.OPEN and obj.deadline_at < timezone.now()

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


# --- what is sold, and who buys it -------------------------------------------------------
class OfferingForm(forms.ModelForm):
    """The admin builds it for Offering with its fieldsets' fields."""

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        network, asset = data.get("network"), data.get("asset")
        token = str((settings.X402_NETWORKS.get(str(network)) or {}).get("token_address") or "")
        if token and asset and str(asset).lower() != token.lower():
            # x402 buyers sign for the asset we name; we settle the network's token.
            self.add_error(
                "asset",
                f"On {network} x402 payments are in the network's token {token}: "
                "the asset must be that address, or no x402 payment could settle.",
            )
        return data


@admin.register(Offering)
class OfferingAdmin(RoleScopedAdmin, admin.ModelAdmin):
    form = OfferingForm
    list_display = (
        "slug",
        "title",
        "price",
        "asset_symbol",
        "network",
        "stock",
        "is_active",
        "version",
    )
    list_filter = ("is_active", "network", "executor", "refund_policy")
    search_fields = ("slug", "title")
    readonly_fields = ("version", "created_at")  # the version moves with the terms
    fieldsets = (
        ("What is sold", {"fields": ("slug", "title", "description", "executor", "is_active")}),
        (
            "Price and payment",
            {"fields": ("price", "asset", "asset_symbol", "asset_decimals", "network", "pay_to")},
        ),
        ("Input", {"fields": ("input_schema", "volatile_fields", "max_input_bytes")}),
        (
            "Stock, delivery and remedies",
            {
                "fields": (
                    "stock",
                    "result_retention",
                    "expected_run_time",
                    "duplicate_window",
                    "delivery_condition",
                    "refund_policy",
                    "irreversible",
                )
            },
        ),
        ("Terms version", {"fields": ("version", "created_at")}),
    )

    def formfield_for_dbfield(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        field = super().formfield_for_dbfield(db_field, request, **kwargs)
        if db_field.name == "stock" and field is not None:
            # Compare against the stock shown on the page, not the row re-read at save time,
            # so stock is written only when someone actually typed a new number.
            field.show_hidden_initial = True
        return field

    def save_model(self, request: HttpRequest, obj: Offering, form: Any, change: bool) -> None:
        if not change:
            super().save_model(request, obj, form, change)
            return
        changes = {name: form.cleaned_data[name] for name in form.changed_data}
        updated = offering_update(offering_id=obj.pk, changes=changes)
        obj.version = updated.version


class BuyerWalletForm(forms.ModelForm):
    class Meta:
        model = BuyerWallet
        fields = ("address",)

    def clean_address(self) -> str:
        # Stored lower-case (as buyer_create does) so lookups by payer never miss on case.
        return str(self.cleaned_data["address"]).strip().lower()


class BuyerWalletInline(RoleScopedAdmin, admin.TabularInline):
    model = BuyerWallet
    form = BuyerWalletForm
    extra = 0


class ApiKeyInline(ReadOnlyInline):
    model = ApiKey
    show_change_link = False
    # Never the hash: the prefix is enough to tell keys apart.
    fields = ("prefix", "label", "created_at", "revoked_at")
    ordering = ("-created_at",)


@admin.register(Buyer)
class BuyerAdmin(RoleScopedAdmin, admin.ModelAdmin):
    list_display = ("ref", "name", "spend_cap", "is_active", "created_at")
    list_filter = ("is_active",)
    search_fields = ("=ref", "name", "=wallets__address")
    readonly_fields = ("ref", "created_at")
    inlines = (BuyerWalletInline, ApiKeyInline)
    actions = ("issue_api_key",)

    def get_fields(self, request: HttpRequest, obj: Buyer | None = None) -> list[Any]:
        if obj is None:
            return ["name", "spend_cap"]  # what buyer_create takes; the ref comes from it
        return ["ref", "name", "spend_cap", "is_active", "created_at"]

    def save_formset(self, request: HttpRequest, form: Any, formset: Any, change: bool) -> None:
        if formset.model is not BuyerWallet:
            super().save_formset(request, form, formset, change)
            return
        # Wallets change only through the buyer services; an edited address is a new wallet.
        edited = formset.save(commit=False)
        for wallet in [*formset.deleted_objects, *[w for w in edited if w.pk]]:
            buyer_wallet_remove(wallet_id=wallet.pk)
        for wallet in edited:
            buyer_wallet_add(buyer=form.instance, address=wallet.address)

    def save_model(self, request: HttpRequest, obj: Buyer, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        created = buyer_create(name=obj.name, spend_cap=obj.spend_cap)
        # Hand the created row to the form so the wallet inline attaches to it.
        obj.pk, obj.ref, obj.created_at = created.pk, created.ref, created.created_at
        obj._state.adding = False
        obj._state.db = created._state.db

    @admin.action(description="Issue API key (shown once)", permissions=["change"])
    def issue_api_key(self, request: HttpRequest, queryset: QuerySet[Buyer]) -> HttpResponse:
        if not self.has_change_permission(request):
            raise PermissionDenied
        label = f"admin:{request.user.get_username()}"
        for buyer in queryset.order_by("pk"):
            raw_key = api_key_issue(buyer=buyer, label=label)
            self.message_user(request, f"API key for {buyer}: {raw_key}", messages.WARNING)
        # Rendered here instead of redirecting, so the key is never parked in a message cookie.
        context = {**self.admin_site.each_context(request), "title": "API keys issued"}
        context["opts"] = self.opts
        return TemplateResponse(request, "admin/purchases/buyer/api_key_issued.html", context)


# --- records kept as evidence -------------------------------------------------------------
@admin.register(Quote)
class QuoteAdmin(ReadOnlyModelAdmin):
    list_display = ("public_id", "offering", "buyer", "price", "state", "expires_at", "created_at")
    list_filter = ("state", "offering")
    list_select_related = ("offering", "buyer")
    search_fields = ("=public_id", "=buyer__ref", "=purchase__ref")


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(ReadOnlyModelAdmin):
    list_display = (
        "scope",
        "principal",
        "purchase",
        "state",
        "recovery_point",
        "response_status",
        "created_at",
    )
    list_filter = ("scope", "state")
    list_select_related = ("purchase",)
    search_fields = ("=key", "=principal", "=purchase__ref")
    # The stored answer is shown as evidence; the lease token is worker plumbing.
    readonly_fields = ("buyer_prepaid_balance",)
    fields = (
        "scope",
        "key",
        "principal",
        "buyer_prepaid_balance",
        "request_fingerprint",
        "purchase",
        "state",
        "response_status",
        "response_headers",
        "response_body",
        "created_at",
        "completed_at",
        "locked_until",
        "compacted_at",
    )

    @admin.display(description="buyer's prepaid balance")
    def buyer_prepaid_balance(self, obj: IdempotencyRecord) -> str:
        # A refused prepaid payment leaves no purchase (it rolled back): its key, found by the
        # payment id the buyer sent, is the case, and the balance explains the refusal.
        balances = LedgerBalance.objects.filter(buyer__ref=obj.principal).order_by("asset")
        units = {o.asset: o for o in Offering.objects.filter(asset__in=[b.asset for b in balances])}
        shown = []
        for balance in balances:
            offering = units.get(balance.asset)
            decimals, symbol = (
                (offering.asset_decimals, offering.asset_symbol) if offering else (0, balance.asset)
            )
            shown.append(f"{amount_human(balance.amount, decimals)} {symbol} ({balance.amount})")
        return "; ".join(shown) or "-"


@admin.register(JobRun)
class JobRunAdmin(ReadOnlyModelAdmin):
    """What each reconciliation pass did: the operator's first stop when a metric lags."""

    list_display = ("job", "started_at", "finished_at", "stats", "error")
    list_filter = ("job",)
    date_hierarchy = "started_at"
