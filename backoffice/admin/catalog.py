"""What is sold and who buys it: offerings (every edit through offering_update, which bumps
the terms version) and buyers with their wallets and API keys (through the buyer services)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet, URLField
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html_join

from core.actors import Actor
from core.admin import (
    ReadOnlyInline,
    RoleScopedAdmin,
)
from fulfillment.models import Upstream
from purchases.models import (
    ApiKey,
    Buyer,
    BuyerWallet,
    Offering,
)
from purchases.selectors import offering_upstream_changes
from purchases.services.fulfil.upstreams import offering_upstream_check, offering_upstream_save
from purchases.services.quote.offerings import (
    offering_asset_problem,
    offering_create,
    offering_update,
)
from purchases.services.shared.buyers import (
    api_key_issue,
    buyer_create,
    buyer_wallet_add,
    buyer_wallet_remove,
)


# --- what is sold, and who buys it -------------------------------------------------------
class OfferingForm(forms.ModelForm):
    """The admin builds it for Offering with its fieldsets' fields."""

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        problem = offering_asset_problem(
            network=str(data.get("network") or ""), asset=str(data.get("asset") or "")
        )
        if problem:
            self.add_error("asset", problem)
        return data


class UpstreamInline(RoleScopedAdmin, admin.StackedInline):
    """Where the offering's work runs when it is not a built-in executor (docs/upstreams.md).
    Validated by Upstream.clean (fulfillment.models.upstream_validate)."""

    model = Upstream
    extra = 0
    max_num = 1
    formfield_overrides = {URLField: {"assume_scheme": "https"}}  # a bare host means https
    verbose_name = "upstream"
    verbose_name_plural = "Upstream (the seller's own operation; empty: the executor above)"


@admin.register(Offering)
class OfferingAdmin(RoleScopedAdmin, admin.ModelAdmin):
    form = OfferingForm
    inlines = (UpstreamInline,)
    list_display = (
        "slug",
        "title",
        "price",
        "asset_symbol",
        "network",
        "stock",
        "is_active",
        "version",
        "managed_by",
    )
    list_filter = ("is_active", "network", "executor", "refund_policy", "catalog_file")
    search_fields = ("slug", "title")
    # The version moves with the terms (an upstream change included), never typed.
    readonly_fields = ("version", "created_at", "upstream_changes", "managed_by")
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
        ("Terms version", {"fields": ("version", "created_at", "upstream_changes")}),
        ("Offerings as code", {"fields": ("managed_by",)}),
    )

    @admin.display(description="managed by", ordering="catalog_file")
    def managed_by(self, obj: Offering) -> str:
        """The catalog file that owns the offering (docs/offerings-as-code.md): an edit here
        holds until that file is applied again, which puts the file's values back."""
        if not obj.catalog_file:
            return "the admin"
        return f"file {obj.catalog_file} (sha256 {obj.catalog_sha256[:12]})"

    @admin.display(description="upstream changes")
    def upstream_changes(self, obj: Offering) -> str:
        """Who changed the upstream, when and what (before -> after), newest first."""
        events = offering_upstream_changes(slug=obj.slug) if obj.pk else []
        if not events:
            return "none recorded"
        return format_html_join(
            "",
            "<div>{} by {}: version {} &rarr; {}; {}</div>",
            (
                (
                    e.created_at.strftime("%Y-%m-%d %H:%M:%S UTC"),
                    e.actor,
                    e.from_state,
                    e.to_state,
                    "; ".join(
                        f"{name} {before!r} -> {after!r}"
                        for name, (before, after) in e.evidence.get("changed", {}).items()
                    ),
                )
                for e in events
            ),
        )

    def get_urls(self) -> list[URLPattern]:
        check = path(
            "<path:object_id>/upstream-check/",
            self.admin_site.admin_view(self.upstream_check_view),
            name="purchases_offering_upstream_check",
        )
        return [check, *super().get_urls()]

    def upstream_check_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The page's "Check upstream" button (its own form, POST only): reach the upstream,
        report each finding as a message. Never a paid effect (fulfillment.upstream_check)."""
        offering = self.get_object(request, unquote(object_id))
        if offering is None:
            raise Http404("no such offering")
        if request.method != "POST" or not self.has_change_permission(request, offering):
            raise PermissionDenied
        check = offering_upstream_check(slug=offering.slug)
        for what, finding in check.lines:
            self.message_user(request, f"{what}: {finding}", messages.INFO)
        verdict = "Upstream check: ok" if check.ok else "Upstream check: a problem (see above)"
        self.message_user(request, verdict, messages.SUCCESS if check.ok else messages.ERROR)
        return HttpResponseRedirect(reverse("admin:purchases_offering_change", args=[offering.pk]))

    def formfield_for_dbfield(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        field = super().formfield_for_dbfield(db_field, request, **kwargs)
        if db_field.name == "stock" and field is not None:
            # Compare against the stock shown on the page, not the row re-read at save time,
            # so stock is written only when someone actually typed a new number.
            field.show_hidden_initial = True
        return field

    def save_model(self, request: HttpRequest, obj: Offering, form: Any, change: bool) -> None:
        actor = Actor.staff(request.user.get_username())
        if not change:
            fields = {name: form.cleaned_data[name] for name in form.cleaned_data}
            created = offering_create(fields=fields, actor=actor)
            # Hand the created row to the form so the upstream inline attaches to it.
            obj.pk, obj.version, obj.created_at = created.pk, created.version, created.created_at
            obj._state.adding = False
            obj._state.db = created._state.db
            return
        changes = {name: form.cleaned_data[name] for name in form.changed_data}
        updated = offering_update(offering_id=obj.pk, changes=changes, actor=actor)
        obj.version = updated.version
        if updated.catalog_file and changes:
            self.message_user(
                request,
                f"{obj.slug} is managed by the catalog file {updated.catalog_file}: the next "
                "apply of that file puts its own values back. Change the file to keep this "
                "edit (docs/offerings-as-code.md).",
                messages.WARNING,
            )

    def save_formset(self, request: HttpRequest, form: Any, formset: Any, change: bool) -> None:
        if formset.model is not Upstream:
            super().save_formset(request, form, formset, change)
            return
        # The upstream through its service: a change is on record (who, what) and moves
        # the offering's terms version, like an edit of the offering's own terms.
        actor = Actor.staff(request.user.get_username())
        # What the admin's own history message reads (formset.save() would set them).
        formset.new_objects, formset.changed_objects, formset.deleted_objects = [], [], []
        for inline in formset.forms:
            deleted = inline in formset.deleted_forms
            if not (deleted or inline.has_changed()):
                continue
            is_new = inline.instance.pk is None
            form.instance.version = offering_upstream_save(
                offering_id=form.instance.pk,
                upstream=None if deleted else inline.instance,
                actor=actor,
            )
            if deleted:
                formset.deleted_objects.append(inline.instance)
            elif is_new:
                formset.new_objects.append(inline.instance)
            else:
                formset.changed_objects.append((inline.instance, inline.changed_data))


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
