"""Records kept as evidence, view-only: quotes, payment ids and housekeeping job runs."""

from __future__ import annotations

from django.contrib import admin
from django.utils.html import format_html

from core.admin import (
    ReadOnlyModelAdmin,
    amount_human,
)
from payments.models import LedgerBalance
from purchases.models import (
    IdempotencyRecord,
    JobRun,
    Offering,
    Quote,
)


# --- records kept as evidence -------------------------------------------------------------
@admin.register(Quote)
class QuoteAdmin(ReadOnlyModelAdmin):
    # Fits 1366 px beside the filters with the buyer's name and ref whole: the offering is a
    # filter and on the quote's page.
    list_display = ("public_id", "buyer", "price", "state", "expires_at", "created_at")
    list_filter = ("state", "offering")
    list_select_related = ("buyer",)
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
    # The stored answer is shown as evidence, and first in words; the lease token is worker
    # plumbing.
    readonly_fields = ("answer_told", "buyer_prepaid_balance")
    fields = (
        "scope",
        "key",
        "principal",
        "answer_told",
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

    @admin.display(description="what the buyer was told")
    def answer_told(self, obj: IdempotencyRecord) -> str:
        """The stored answer in a sentence: a refusal (a problem document) by its code, what
        it means and whose move it is; anything else by its status."""
        if obj.response_status is None:
            return "Nothing yet: the request under this payment id has not answered."
        body = obj.response_body if isinstance(obj.response_body, dict) else {}
        code = body.get("code")
        if not code:
            ref = body.get("purchase") or (obj.purchase.ref if obj.purchase else "")
            return format_html(
                "<strong>{}</strong>{}", obj.response_status, f": purchase {ref}" if ref else ""
            )
        charged = (
            "Nothing was charged: no purchase was made."
            if obj.purchase_id is None and 400 <= obj.response_status < 500
            else ""
        )
        return format_html(
            "<strong>{} {}</strong>: {} {}<br>Next: {} (the {}'s move{}).",
            obj.response_status,
            code,
            body.get("detail") or body.get("title") or "",
            charged,
            str(body.get("next_action") or "-").replace("_", " "),
            body.get("owner") or "buyer",
            "; retrying may succeed" if body.get("retryable") else "",
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
