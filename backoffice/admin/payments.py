"""The back office for finance: the refund-owed list, the prepaid ledger, payment attempts.

Refunds change only through purchase_refund_mark_paid and the ledger only through
ledger_credit; nothing here edits a row. What each role sees is backoffice.roles' table;
the CSV, export batches and balances are in backoffice.admin.finance.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, StreamingHttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext

from backoffice.admin.case_file import attempt_transfer_note
from backoffice.admin.finance import (
    human_amount_of,
    ledger_reference_of_refunds,
    refund_csv_response,
    refund_safe_batch,
    with_asset_units,
)
from backoffice.admin.payouts import approve_payouts_view, refund_payout_status
from core.actors import Actor
from core.admin import CappedCountPaginator, ReadOnlyModelAdmin, amount_human
from payments.models import LedgerEntry, PaymentAttempt, Refund
from payments.paybacks import RefundPaybackRefused
from payments.rails.x402.payback import MESSAGES, PaybackCode
from payments.services import (
    LedgerReferenceConflict,
    ledger_balance,
    ledger_credit_once,
    refund_reference_problem,
)
from purchases.models import Buyer, Offering
from purchases.selectors import refund_search_ids
from purchases.services.remedy.paybacks import purchase_refund_match_confirm
from purchases.services.remedy.remedies import purchase_refund_mark_paid

if TYPE_CHECKING:
    from django.contrib.admin.filters import _ListFilterChoices


def refund_amount_human(refund: Refund) -> Decimal:
    # The offering knows the asset's decimals (USDC: 6); the refund carries only the address.
    return amount_human(refund.amount, refund.purchase.offering.asset_decimals)


@admin.register(PaymentAttempt)
class PaymentAttemptAdmin(ReadOnlyModelAdmin):
    # Fits 1366 px beside the filters with the wallet and the tx hash readable: the network
    # is a filter and on the attempt's page, as on the refund list.
    list_display = (
        "pk",
        "purchase",
        "rail",
        "payer",
        "amount",
        "state",
        "transfer_note",
        "tx_hash",
        "created_at",
    )
    list_filter = ("rail", "state", "network")
    list_select_related = ("purchase",)
    search_fields = ("=purchase__ref", "=payer", "=tx_hash", "=settlement_reference")
    readonly_fields = ("transfer_note",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[PaymentAttempt]:
        # The late/duplicate label reads the attempt's refunds: one query for the page.
        return super().get_queryset(request).prefetch_related("refunds")

    @admin.display(description="late or duplicate transfer")
    def transfer_note(self, obj: PaymentAttempt) -> str:
        # "failed" alone would hide that its money landed after all and is owed back.
        return attempt_transfer_note(obj)


# --- refunds: the owed list, paid back with a reference, exported for the books ------
class RefundStateFilter(admin.SimpleListFilter):
    """Defaults to "owed": the list finance opens is the work still to do."""

    title = "state"
    parameter_name = "state"
    default = Refund.State.OWED

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        return [("owed", "Owed"), ("paid", "Paid back"), ("all", "All")]

    def queryset(self, request: Any, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value() or self.default
        return queryset if value == "all" else queryset.filter(state=value)

    def choices(self, changelist: ChangeList) -> Iterator[_ListFilterChoices]:
        current = self.value() or self.default
        for lookup, title in self.lookup_choices:
            yield {
                "selected": current == lookup,
                "query_string": changelist.get_query_string({self.parameter_name: lookup}),
                "display": title,
            }


class RefundNetworkFilter(admin.SimpleListFilter):
    """The networks offerings sell on: a refund's is its purchase's. Django's field filter
    would read every refund for its distinct values (0.5 s at a million)."""

    title = "network"
    parameter_name = "network"

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        networks = Offering.objects.order_by("network").values_list("network", flat=True)
        return [(network, network) for network in dict.fromkeys(networks)]

    def queryset(self, request: Any, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(network=value) if value else queryset


class RefundReasonFilter(admin.SimpleListFilter):
    """The reason codes of the latest REASON_WINDOW refunds (a bounded read of the primary
    key), and the one chosen: reading every refund for its distinct codes took 0.5 s at a
    million. An older code still filters by its URL (`?reason_code=...`)."""

    title = "reason code"
    parameter_name = "reason_code"
    REASON_WINDOW = 5_000

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        latest = Refund.objects.order_by("-pk").values_list("reason_code", flat=True)
        codes = set(latest[: self.REASON_WINDOW])
        if self.value():
            codes.add(str(self.value()))
        return [(code, code) for code in sorted(codes)]

    def queryset(self, request: Any, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(reason_code=value) if value else queryset


class MarkPaidForm(forms.Form):
    """One reference per refund: each pay-back is its own transfer (or ledger credit)."""

    def __init__(self, *args: Any, refunds: list[Refund], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refunds = {f"reference_{refund.pk}": refund for refund in refunds}
        for name, refund in self.refunds.items():
            on_chain = refund.method == Refund.Method.PAY_BACK
            self.fields[name] = forms.CharField(
                max_length=200,
                label=f"{refund.purchase.ref}: {refund_amount_human(refund)} "
                f"{refund.purchase.offering.asset_symbol} to {refund.payer} on {refund.network}",
                help_text="Transaction hash of the payback (0x + 64 hex)."
                if on_chain
                else "Reference of the ledger credit that paid it back (e.g. top_up:…).",
            )

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        for name, refund in self.refunds.items():
            if name in data:
                problem = refund_reference_problem(refund=refund, reference=data[name])
                if problem:
                    self.add_error(name, problem)
        return data


def _utc(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S UTC") if value else "-"


def payback_status(refund: Refund) -> str:
    """What the chain said of this refund's payback, in finance's words, with its code:
    closed by, pending (why, and when it is looked at again), a match to confirm, or none."""
    if refund.state == Refund.State.PAID and refund.payback_log_index is not None:
        return f"closed on chain by {refund.payback_tx_hash} (log {refund.payback_log_index})"
    if refund.payback_tx_hash and refund.payback_next_check_at:
        code = PaybackCode(refund.payback_code)
        evidence = refund.payback_evidence or {}
        depth = ""
        if "depth" in evidence and "finality_depth" in evidence:
            depth = f" (depth {evidence['depth']} of {evidence['finality_depth']})"
        return (
            f"{code.value}: {MESSAGES[code]}{depth} {refund.payback_tx_hash}; "
            f"checked again at {_utc(refund.payback_next_check_at)}"
        )
    if refund.match_tx_hash:
        return (
            f"match on chain: {refund.match_tx_hash} (block {refund.match_block_number}); "
            "confirm it with “Confirm payback found on chain”"
        )
    return "-"


@admin.register(Refund)
class RefundAdmin(ReadOnlyModelAdmin):
    # Fits 1366 px beside the navigation and the filters (templates/admin/payments/refund/
    # change_list.html wraps the hashes): the amount's atomic units share its cell, and the
    # network is a filter, on the refund's page and in the CSV.
    list_display = (
        "pk",
        "purchase",
        "payer",
        "transaction",
        "amount_human",
        "method",
        "reason_code",
        "state",
        "created_at",
        "paid_back",
        "ledger_reference",
    )
    list_filter = (RefundStateFilter, "method", RefundNetworkFilter, RefundReasonFilter)
    list_select_related = ("purchase", "purchase__offering")
    # At a million refunds: exact look-ups run as one UNION of index look-ups
    # (get_search_results), a bounded count, no full count, no filter reading every row.
    search_fields = ("=purchase__ref", "=payer", "=transaction", "=paid_reference")
    show_full_result_count = False
    paginator = CappedCountPaginator
    readonly_fields = ("amount_human", "asset_symbol", "ledger_reference", "payback", "payout")
    fields = (
        "purchase",
        "payment_attempt",
        "method",
        "amount",
        "amount_human",
        "asset_symbol",
        "asset",
        "network",
        "payer",
        "transaction",
        "reason_code",
        "state",
        "note",
        "proposed_by",
        "decided_by",
        "decided_at",
        "created_at",
        "paid_reference",
        "ledger_reference",
        "paid_by",
        "paid_at",
        "payback",
        "payout",
        "payback_tx_hash",
        "payback_log_index",
        "payback_block_number",
        "payback_code",
        "payback_evidence",
        "payback_checked_at",
        "payback_next_check_at",
        "match_tx_hash",
        "match_log_index",
        "match_block_number",
        "match_found_at",
    )
    actions = (
        "approve_payouts",
        "mark_paid_back",
        "confirm_payback_match",
        "export_safe_batch",
        "export_csv",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Refund]:
        # Each row's payouts (few, usually none): one query for the page.
        return ledger_reference_of_refunds(super().get_queryset(request)).prefetch_related(
            "payouts"
        )

    def action_checkbox(self, obj: Refund) -> SafeString:
        # Django's own markup, written without a widget template per row: the 100 widget
        # renders were 40% of the list's time at a million refunds (bench/scale.py).
        label = format_html(gettext("Select this object for an action - {}"), str(obj))
        return format_html(
            '<input type="checkbox" name="{}" value="{}" class="action-select" aria-label="{}">',
            helpers.ACTION_CHECKBOX_NAME,
            obj.pk,
            label,
        )

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Refund], search_term: str
    ) -> tuple[QuerySet[Refund], bool]:
        if not search_term.strip():
            return queryset, False
        kinds = [name.lstrip("=^@") for name in self.get_search_fields(request)]
        return queryset.filter(pk__in=refund_search_ids(term=search_term, kinds=kinds)), False

    @admin.display(description="amount", ordering="amount")
    def amount_human(self, obj: Refund) -> str:
        # As on the case file: asset units, the atomic units beside them.
        return f"{refund_amount_human(obj)} {obj.purchase.offering.asset_symbol} ({obj.amount})"

    @admin.display(description="asset symbol")
    def asset_symbol(self, obj: Refund) -> str:
        return obj.purchase.offering.asset_symbol

    @admin.display(description="ledger credit")
    def ledger_reference(self, obj: Refund) -> str:
        return getattr(obj, "ledger_reference", None) or "-"

    @admin.display(description="payback on chain")
    def payback(self, obj: Refund) -> str:
        return payback_status(obj)

    @admin.display(description="payout")
    def payout(self, obj: Refund) -> str:
        return refund_payout_status(obj) or "-"

    @admin.display(description="paid reference", ordering="paid_reference")
    def paid_back(self, obj: Refund) -> str:
        # One cell for what paid it back, or what the chain offers (the page fits 1366 px):
        # the reference, a pending payout or payback and its next check, or a match.
        if obj.state == Refund.State.PAID:
            return obj.paid_reference
        payout = refund_payout_status(obj)
        if payout and "pending" in payout:
            return payout
        if obj.payback_tx_hash and obj.payback_next_check_at:
            return f"pending: {obj.payback_code}, next check {_utc(obj.payback_next_check_at)}"
        if obj.match_tx_hash:
            return f"match found: {obj.match_tx_hash}, confirm it"
        return "-"

    def has_approve_payouts_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self.role_allows_action(request, "approve_payouts")

    @admin.action(
        description="Pay out from the refund wallet (approve batch)",
        permissions=["approve_payouts"],
    )
    def approve_payouts(
        self, request: HttpRequest, queryset: QuerySet[Refund]
    ) -> HttpResponse | None:
        return approve_payouts_view(self, request, queryset)

    def has_mark_paid_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self.role_allows_action(request, "mark_paid_back")

    @admin.action(description="Mark paid back", permissions=["mark_paid"])
    def mark_paid_back(
        self, request: HttpRequest, queryset: QuerySet[Refund]
    ) -> HttpResponse | None:
        if not self.has_mark_paid_permission(request):
            raise PermissionDenied
        owed = list(
            queryset.filter(state=Refund.State.OWED)
            .select_related("purchase__offering")
            .order_by("pk")
        )
        if not owed:
            self.message_user(request, "Nothing to mark: already paid back.", messages.WARNING)
            return None
        submitted = "apply" in request.POST
        form = MarkPaidForm(request.POST if submitted else None, refunds=owed)
        if submitted:
            if form.is_valid() and self._mark_all(request, owed, form):
                return None
            self.message_user(
                request,
                "Not every refund could be closed: see the reason by each reference.",
                messages.ERROR,
            )
        context = {
            **self.admin_site.each_context(request),
            "title": "Mark refunds paid back",
            "opts": self.opts,
            "form": form,
            "refunds": owed,
        }
        return TemplateResponse(request, "admin/payments/refund/mark_paid.html", context)

    def _mark_all(self, request: HttpRequest, refunds: list[Refund], form: MarkPaidForm) -> bool:
        """Close each refund by its reference; False when one was refused (its field says
        why, by the failed check's code). A payback not final yet is reported pending."""
        username, marked, refused = request.user.get_username(), 0, False
        for refund in refunds:
            now = timezone.now()
            field = f"reference_{refund.pk}"
            try:
                locked = purchase_refund_mark_paid(
                    refund_id=refund.pk,
                    reference=form.cleaned_data[field],
                    now=now,
                    actor=Actor.staff(username),
                )
            except RefundPaybackRefused as exc:
                form.add_error(field, str(exc))
                refused = True
                continue
            except ValueError:
                continue  # paid back by someone else, under another reference
            if locked.state == Refund.State.OWED:
                self._say_pending(request, locked)
            # Paid by someone else between the list and the lock: not ours to count.
            marked += locked.paid_at == now
        if marked:
            self.message_user(request, f"Marked {marked} refund(s) paid back.", messages.SUCCESS)
        return not refused

    def _say_pending(self, request: HttpRequest, refund: Refund) -> None:
        self.message_user(
            request,
            f"Refund {refund.pk} ({refund.purchase.ref}) stays owed, its payback pending: "
            f"{payback_status(refund)}.",
            messages.WARNING,
        )

    @admin.action(description="Confirm payback found on chain", permissions=["mark_paid"])
    def confirm_payback_match(self, request: HttpRequest, queryset: QuerySet[Refund]) -> None:
        """One click per match the payback watch offered: judged on chain as a pasted hash."""
        if not self.has_mark_paid_permission(request):
            raise PermissionDenied
        matched = list(
            queryset.filter(state=Refund.State.OWED)
            .exclude(match_tx_hash="")
            .select_related("purchase")
            .order_by("pk")
        )
        if not matched:
            self.message_user(request, "No payback found on chain for these.", messages.WARNING)
            return
        actor, closed = Actor.staff(request.user.get_username()), 0
        for refund in matched:
            try:
                recorded = purchase_refund_match_confirm(refund_id=refund.pk, now=None, actor=actor)
            except RefundPaybackRefused as exc:
                self.message_user(
                    request, f"Refund {refund.pk} ({refund.purchase.ref}): {exc}", messages.ERROR
                )
                continue
            except ValueError:
                continue
            if recorded.verdict.closes:
                closed += 1
            else:
                self._say_pending(request, recorded.refund)
        if closed:
            self.message_user(
                request, f"Confirmed {closed} payback(s): refund(s) paid back.", messages.SUCCESS
            )

    @admin.action(
        description="Export Safe Transaction Builder batch (JSON, recorded)", permissions=["export"]
    )
    def export_safe_batch(
        self, request: HttpRequest, queryset: QuerySet[Refund]
    ) -> HttpResponse | None:
        """The ticked chain refunds still owed, as one Safe batch of token transfers (one
        network per file); the payback watch then finds each transfer (docs/finance.md)."""
        owed = list(
            queryset.filter(state=Refund.State.OWED, method=Refund.Method.PAY_BACK).order_by("pk")
        )
        networks = {refund.network for refund in owed}
        if len(networks) != 1:
            self.message_user(
                request,
                "Tick owed chain refunds of one network: a Safe batch runs on one chain.",
                messages.ERROR,
            )
            return None
        body = refund_safe_batch(refunds=owed, created_by=request.user.get_username())
        response = HttpResponse(body, content_type="application/json")
        response["Content-Disposition"] = 'attachment; filename="refunds-safe-batch.json"'
        return response

    @admin.action(description="Export CSV (recorded as a batch)", permissions=["export"])
    def export_csv(self, request: HttpRequest, queryset: QuerySet[Refund]) -> StreamingHttpResponse:
        return refund_csv_response(request, queryset, scoping=self.role_scoping(request))

    def has_export_permission(self, request: HttpRequest) -> bool:
        return self.role_allows_action(request, "export_csv")


# --- the prepaid ledger: read-only, topped up through ledger_credit ---------------------
def _asset_choices() -> list[tuple[str, str]]:
    assets = Offering.objects.values_list("asset", "asset_symbol", "network").distinct()
    return [(asset, f"{symbol} {asset} ({network})") for asset, symbol, network in assets]


class TopUpForm(forms.Form):
    buyer = forms.ModelChoiceField(queryset=Buyer.objects.filter(is_active=True).order_by("name"))
    asset = forms.ChoiceField(choices=_asset_choices)
    amount = forms.DecimalField(
        min_value=Decimal("0.000001"),
        # Bounded before any arithmetic: "1e999999" is a valid Decimal.
        max_digits=30,
        help_text="In asset units, e.g. 12.50 USDC.",
    )
    reference = forms.CharField(
        max_length=100,
        help_text="The incoming payment's own reference (bank transfer, invoice, tx hash). "
        "Posting the same reference twice credits once.",
    )
    memo = forms.CharField(max_length=150, required=False)

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if "asset" in data and "amount" in data:
            offering = Offering.objects.filter(asset=data["asset"]).first()
            decimals = offering.asset_decimals if offering is not None else 6
            atomic = Decimal(data["amount"]).scaleb(decimals)
            if atomic != atomic.to_integral_value():
                self.add_error("amount", f"This asset has {decimals} decimals.")
            elif "buyer" in data and atomic > _BALANCE_MAX - ledger_balance(
                buyer_id=data["buyer"].pk, asset=data["asset"]
            ):
                self.add_error("amount", "This would exceed the largest balance the ledger holds.")
            else:
                data["amount_atomic"] = int(atomic)
        return data


# A running balance is a 64-bit integer of atomic units (LedgerBalance.amount).
_BALANCE_MAX = 2**63 - 1


@admin.register(LedgerEntry)
class LedgerEntryAdmin(ReadOnlyModelAdmin):
    # Fits 1366 px beside the filters: the atomic units share the amount's cell (as on the
    # refund list) and the asset, named by its symbol there, is a filter and on the entry.
    list_display = (
        "reference",
        "buyer",
        "kind",
        "amount_human",
        "purchase",
        "created_at",
    )
    list_filter = ("kind", "asset")
    list_select_related = ("buyer", "purchase")
    search_fields = ("=reference", "=buyer__ref", "=purchase__ref")
    readonly_fields = ("amount_human",)
    change_list_template = "admin/payments/ledgerentry/change_list.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[LedgerEntry]:
        return with_asset_units(super().get_queryset(request))

    @admin.display(description="amount", ordering="amount")
    def amount_human(self, obj: LedgerEntry) -> str:
        # Asset units, the atomic units beside them (signed: a debit is negative).
        return f"{human_amount_of(obj)} ({obj.amount})"

    def has_top_up_permission(self, request: HttpRequest) -> bool:
        return self.role_allows_action(request, "top_up")

    def get_urls(self) -> list[URLPattern]:
        top_up = path(
            "top-up/",
            self.admin_site.admin_view(self.top_up_view),
            name="payments_ledgerentry_top_up",
        )
        return [top_up, *super().get_urls()]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        context = {**(extra_context or {}), "can_top_up": self.has_top_up_permission(request)}
        return super().changelist_view(request, context)

    def top_up_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_top_up_permission(request):
            raise PermissionDenied
        form = TopUpForm(request.POST if request.method == "POST" else None)
        if request.method == "POST" and form.is_valid():
            self._top_up(request, form.cleaned_data)
            return HttpResponseRedirect(reverse("admin:payments_ledgerentry_changelist"))
        context = {
            **self.admin_site.each_context(request),
            "title": "Top up a prepaid balance",
            "opts": self.opts,
            "form": form,
        }
        return TemplateResponse(request, "admin/payments/ledgerentry/top_up.html", context)

    def _top_up(self, request: HttpRequest, data: dict[str, Any]) -> None:
        reference = f"top_up:{data['reference']}"
        # The ledger row has no actor column: the memo is where "who posted it" lives.
        who = f"top-up by {request.user.get_username()}"
        memo = f"{who}: {data['memo']}" if data["memo"] else who
        try:
            _, posted = ledger_credit_once(
                buyer_id=data["buyer"].pk,
                asset=data["asset"],
                amount=data["amount_atomic"],
                kind=LedgerEntry.Kind.TOP_UP,
                reference=reference,
                memo=memo[:200],
            )
        except LedgerReferenceConflict:
            # The reference already holds another entry: say so, never pretend to credit.
            self.message_user(
                request,
                f"Reference {reference} is already used by another entry; nothing was posted.",
                messages.ERROR,
            )
            return
        if not posted:
            # A double submit or a retried posting: the first one credited, this one did not.
            self.message_user(
                request,
                f"{reference} was already credited ({data['amount']} to {data['buyer']}); "
                "nothing more was posted.",
                messages.WARNING,
            )
            return
        self.message_user(
            request,
            f"Credited {data['amount']} to {data['buyer']} as {reference} "
            "(once: the same reference never credits twice).",
            messages.SUCCESS,
        )
