"""Finance's books in the back office: the refund CSV (streamed, recorded as a batch), the
export batches, and each buyer's prepaid balance in asset units."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django import forms
from django.conf import settings
from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import Case, CharField, OuterRef, QuerySet, Subquery, When
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils import timezone

from backoffice.books import Period, PeriodInvalid
from backoffice.books_export import books_export_stream
from core.admin import ReadOnlyModelAdmin, RoleScoping, amount_human
from core.exports import StreamSummary, csv_stream
from payments.chain.safe_batch import SafeTransfer, safe_transfer_batch
from payments.models import ExportBatch, LedgerBalance, LedgerEntry, Refund
from payments.rails.x402.networks import network_config
from payments.services import export_batch_record
from purchases.models import Offering


@dataclass(frozen=True)
class CsvColumn:
    header: str
    # The refund field (backoffice.roles names) a role must see to get this column.
    shown_with: str
    # The value read for it (amounts and times are formatted after reading); None: computed
    # from the others.
    source: str | None


# The refund CSV, column by column, in file order: what it is called, who sees it, what it
# reads. The header, the role filter and the query all come from this one list.
REFUND_CSV_COLUMNS = (
    CsvColumn("purchase", "purchase", "purchase__ref"),
    CsvColumn("method", "method", "method"),
    CsvColumn("payer", "payer", "payer"),
    CsvColumn("amount_atomic", "amount", "amount"),
    CsvColumn("amount", "amount_human", None),  # asset units, from amount_atomic and decimals
    CsvColumn("asset_symbol", "asset_symbol", "purchase__offering__asset_symbol"),
    CsvColumn("asset", "asset", "asset"),
    CsvColumn("network", "network", "network"),
    CsvColumn("transaction", "transaction", "transaction"),
    CsvColumn("reason", "reason_code", "reason_code"),
    CsvColumn("state", "state", "state"),
    CsvColumn("created_at", "created_at", "created_at"),
    CsvColumn("paid_reference", "paid_reference", "paid_reference"),
    CsvColumn("ledger_reference", "ledger_reference", "ledger_reference"),
    CsvColumn("paid_at", "paid_at", "paid_at"),
)
# The columns read from the database, in query order.
_READ_COLUMNS = tuple(column.header for column in REFUND_CSV_COLUMNS if column.source)
_READ_FIELDS = tuple(source for column in REFUND_CSV_COLUMNS if (source := column.source))
EXPORT_CREATED_AT = _READ_COLUMNS.index("created_at")
# Rows fetched per round trip of the server-side cursor: memory stays flat at any size.
EXPORT_CHUNK_ROWS = 2000


def _iso(value: datetime | None) -> str:
    return value.isoformat() if value is not None else ""


def ledger_reference_of_refunds(refunds: QuerySet[Refund]) -> QuerySet[Refund]:
    """Annotate the ledger entry that credited each prepaid refund (checked, not assumed)."""
    credit = LedgerEntry.objects.filter(reference=OuterRef("paid_reference"), amount__gt=0)
    return refunds.annotate(
        ledger_reference=Case(
            When(
                method=Refund.Method.LEDGER_CREDIT,
                then=Subquery(credit.values("reference")[:1]),
            ),
            default=None,
            output_field=CharField(),
        )
    )


# --- the refund CSV: streamed, and recorded as a batch when the stream ends --------------
def refund_csv_response(
    request: HttpRequest, refunds: QuerySet[Refund], *, scoping: RoleScoping
) -> StreamingHttpResponse:
    """The refunds as CSV, oldest first, with only the columns the role sees.

    The batch row is written when the last byte was handed to the server (core.exports);
    an abandoned download records nothing."""
    columns = [column.header for column in REFUND_CSV_COLUMNS if scoping.sees(column.shown_with)]
    rows = ledger_reference_of_refunds(refunds).order_by("created_at", "pk")
    created_by, started_at = request.user.get_username(), timezone.now()
    filters = _export_filters(request)

    def record(summary: StreamSummary) -> None:
        export_batch_record(
            kind="refunds",
            created_by=created_by,
            filters=filters,
            started_at=started_at,
            row_count=summary.row_count,
            sha256=summary.sha256,
            first_created_at=summary.first_created_at,
            last_created_at=summary.last_created_at,
        )

    lines = csv_stream(columns, _csv_rows(rows, columns), record)
    response = StreamingHttpResponse(lines, content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="refunds.csv"'
    return response


def _export_filters(request: HttpRequest) -> dict[str, Any]:
    # The list's filters and search (the query string) and what was ticked.
    selected = request.POST.getlist("_selected_action")
    across = request.POST.get("select_across") == "1"
    return {
        "query": {key: request.GET.getlist(key) for key in sorted(request.GET)},
        "selection": "all matching" if across else f"{len(selected)} ticked",
    }


def _csv_rows(
    refunds: QuerySet[Refund], columns: list[str]
) -> Iterator[tuple[list[str], datetime]]:
    # Plain values, not model instances: a million rows stream several times faster.
    fields = [*_READ_FIELDS, "purchase__offering__asset_decimals"]
    # Read inside a transaction: outside one, PostgreSQL's server-side cursor is declared
    # WITH HOLD and filled with every row before the first is read. Inside, rows come as the
    # index on (created_at, id) yields them, so the download starts at once.
    with transaction.atomic():
        for row in refunds.values_list(*fields).iterator(chunk_size=EXPORT_CHUNK_ROWS):
            values = dict(zip(_READ_COLUMNS, row, strict=False))
            values.update(
                amount_atomic=str(values["amount_atomic"]),
                amount=str(amount_human(values["amount_atomic"], row[-1])),
                created_at=_iso(values["created_at"]),
                paid_at=_iso(values["paid_at"]),
                ledger_reference=values["ledger_reference"] or "",
            )
            yield [values[c] for c in columns], row[EXPORT_CREATED_AT]


# --- the books of a period -----------------------------------------------------------------
class BooksPeriodForm(forms.Form):
    """A closed period: a UTC month, or a first and last day (both included)."""

    month = forms.CharField(
        required=False,
        widget=forms.TextInput(attrs={"type": "month", "placeholder": "YYYY-MM"}),
        help_text="A whole month (UTC), e.g. 2026-11. Or leave empty and give the days below.",
    )
    first_day = forms.DateField(required=False, widget=forms.DateInput(attrs={"type": "date"}))
    last_day = forms.DateField(
        required=False,
        widget=forms.DateInput(attrs={"type": "date"}),
        help_text="Included. The period must have ended (UTC) before it can be exported.",
    )
    include_self_payments = forms.BooleanField(
        required=False,
        help_text="Count payments from the seller's own wallets as revenue (flagged either way).",
    )

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        try:
            if data.get("month"):
                period = Period.month(data["month"])
            elif data.get("first_day") and data.get("last_day"):
                period = Period.days(data["first_day"], data["last_day"])
            else:
                raise PeriodInvalid("Give a month, or a first and a last day.")
            period.check_closed(now=timezone.now())
        except PeriodInvalid as exc:
            raise forms.ValidationError(str(exc)) from exc
        data["period"] = period
        return data


def books_view(model_admin: Any, request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    """The form, and on a valid POST the period's books as a CSV download (recorded)."""
    if not model_admin.role_allows_action(request, "export_books"):
        raise PermissionDenied
    form = BooksPeriodForm(request.POST if request.method == "POST" else None)
    if request.method == "POST" and form.is_valid():
        period = form.cleaned_data["period"]
        # Streamed: the batch (with the SHA-256 of exactly the bytes sent) is recorded when
        # the last chunk went out, so no header can carry the hash; the batch list shows it.
        chunks = books_export_stream(
            period=period,
            created_by=request.user.get_username(),
            include_self_payments=form.cleaned_data["include_self_payments"],
        )
        response = StreamingHttpResponse(chunks, content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="books-{period.slug}.csv"'
        return response
    context = {
        **model_admin.admin_site.each_context(request),
        "title": "Export a period's books",
        "opts": model_admin.opts,
        "form": form,
    }
    return TemplateResponse(request, "admin/payments/exportbatch/books.html", context)


# --- a Safe Transaction Builder batch of the owed chain refunds ---------------------------
def refund_safe_batch(*, refunds: list[Refund], created_by: str) -> bytes:
    """The refunds (owed, one network) as a Safe Transaction Builder file, recorded as an
    export batch with its SHA-256 and the refunds it holds. The Safe is
    TOLLBOOTH_REFUND_SAFE, one of the seller's wallets."""
    started_at = timezone.now()
    network = network_config(refunds[0].network)
    batch = safe_transfer_batch(
        chain_id=network.chain_id,
        token=network.token_address,
        transfers=[SafeTransfer(refund.payer, refund.amount) for refund in refunds],
        safe_address=settings.TOLLBOOTH.get("REFUND_SAFE", ""),
        name=f"Tollbooth refunds {started_at:%Y-%m-%d %H:%M} UTC",
        description="Refunds " + ", ".join(str(refund.pk) for refund in refunds),
        created_at_ms=int(started_at.timestamp() * 1000),
    )
    body = json.dumps(batch, indent=2).encode()
    export_batch_record(
        kind="safe_batch",
        created_by=created_by,
        # Which refunds went to which Safe: the payback watch closes each one when the
        # Safe's transfer of it is on chain and final (payments.safe_refunds).
        filters={
            "refunds": [refund.pk for refund in refunds],
            "network": network.caip2,
            "safe": str(batch["meta"]["createdFromSafeAddress"]).lower(),
        },
        row_count=len(refunds),
        sha256=hashlib.sha256(body).hexdigest(),
        started_at=started_at,
        first_created_at=min(refund.created_at for refund in refunds),
        last_created_at=max(refund.created_at for refund in refunds),
    )
    return body


@admin.register(ExportBatch)
class ExportBatchAdmin(ReadOnlyModelAdmin):
    """Every finished export: compare a re-export by its row count and SHA-256."""

    change_list_template = "admin/payments/exportbatch/change_list.html"

    def get_urls(self) -> list[URLPattern]:
        books = path(
            "books/",
            self.admin_site.admin_view(lambda request: books_view(self, request)),
            name="payments_exportbatch_books",
        )
        return [books, *super().get_urls()]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        context = {**(extra_context or {}), "can_export_books": self.role_allows_action(
            request, "export_books")}  # fmt: skip
        return super().changelist_view(request, context)

    list_display = (
        "pk",
        "kind",
        "created_by",
        "created_at",
        "row_count",
        "first_created_at",
        "last_created_at",
        "sha256",
    )
    list_filter = ("kind",)
    search_fields = ("=sha256", "=created_by")
    search_help_text = "SHA-256 of a file, or who exported it."
    date_hierarchy = "created_at"
    fields = (
        "kind",
        "created_by",
        "started_at",
        "created_at",
        "filters",
        "row_count",
        "first_created_at",
        "last_created_at",
        "sha256",
    )


# --- prepaid balances, in asset units -----------------------------------------------------
def with_asset_units(rows: QuerySet[Any]) -> QuerySet[Any]:
    """Annotate the asset's symbol and decimals (from the offering selling in it): ledger
    rows carry only the asset's address."""
    offering = Offering.objects.filter(asset=OuterRef("asset")).order_by("pk")
    return rows.annotate(
        asset_symbol=Subquery(offering.values("asset_symbol")[:1]),
        asset_decimals=Subquery(offering.values("asset_decimals")[:1]),
    )


def human_amount_of(obj: Any) -> str:
    """`amount` in asset units with the symbol, for a row annotated by with_asset_units."""
    decimals = getattr(obj, "asset_decimals", None)
    if decimals is None:
        return "-"  # no offering sells in this asset: its decimals are unknown
    return f"{amount_human(obj.amount, decimals)} {obj.asset_symbol}"


@admin.register(LedgerBalance)
class LedgerBalanceAdmin(ReadOnlyModelAdmin):
    """Each buyer's prepaid balance per asset: the running total the ledger keeps."""

    list_display = ("buyer", "asset", "amount", "amount_human", "updated_at")
    list_filter = ("asset",)
    list_select_related = ("buyer",)
    search_fields = ("=buyer__ref",)
    search_help_text = "Buyer ref."
    readonly_fields = ("amount_human",)
    fields = ("buyer", "asset", "amount", "amount_human", "updated_at")
    ordering = ("buyer", "asset")

    def get_queryset(self, request: HttpRequest) -> QuerySet[LedgerBalance]:
        return with_asset_units(super().get_queryset(request))

    @admin.display(description="balance (asset units)")
    def amount_human(self, obj: LedgerBalance) -> str:
        return human_amount_of(obj)
