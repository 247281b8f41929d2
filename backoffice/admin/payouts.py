"""Payouts in the back office: finance approves a batch of owed chain refunds (an action on
the refund list), a second approver approves a payout to another wallet than the payer's,
and every payout is on its own list with what a pending one awaits and its next check.
Nothing here changes a row: purchases.services.remedy.payouts does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from core.actors import Actor
from core.admin import ReadOnlyModelAdmin, amount_human
from payments.models import Payout, Refund
from payments.payouts import Awaiting
from purchases.services.remedy.payouts import (
    PayoutRefused,
    payout_cancel,
    payout_second_approve,
    refunds_payout_approve,
)

AWAITING_WORDS = {
    Awaiting.SECOND_APPROVAL: "awaiting a second approver (another staff user)",
    Awaiting.BROADCAST: "signed and recorded, awaiting its broadcast",
    Awaiting.INCLUSION: "broadcast, awaiting inclusion in a block",
    Awaiting.FINALITY: "mined, awaiting finality",
    Awaiting.NODE: "awaiting the node (it could not be asked)",
    Awaiting.ATTENTION: "mined but not accepted as the payback: a person must look",
}


def _utc(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S UTC") if value else "-"


def payout_status(payout: Payout) -> str:
    """A payout in finance's words: paid (its transaction), failed (why), or pending with
    what it awaits and when it is looked at next."""
    if payout.state == Payout.State.CONFIRMED:
        return f"paid by payout {payout.pk}: {payout.tx_hash} (block {payout.block_number})"
    if payout.state in (Payout.State.FAILED, Payout.State.CANCELLED):
        return f"payout {payout.pk} {payout.state}: {payout.reason_code}"
    words = (
        AWAITING_WORDS.get(Awaiting(payout.awaiting), payout.awaiting) if payout.awaiting else ""
    )
    evidence = payout.evidence or {}
    if "depth" in evidence and "finality_depth" in evidence:
        words += f" (depth {evidence['depth']} of {evidence['finality_depth']})"
    check = (
        ""
        if payout.awaiting == Awaiting.SECOND_APPROVAL
        else (f", next check {_utc(payout.next_check_at)}")
    )
    return f"payout {payout.pk} pending: {words}{check}"


def refund_payout_status(refund: Refund) -> str | None:
    """The refund's latest payout, in finance's words; None when it has none."""
    payouts = list(refund.payouts.all())  # prefetched by the list
    if not payouts:
        return None
    return payout_status(max(payouts, key=lambda p: p.pk))


class ApprovePayoutsForm(forms.Form):
    """One destination per refund, the payer's wallet unless changed (then a second
    approver must approve it before anything is signed or sent)."""

    def __init__(self, *args: Any, refunds: list[Refund], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refunds = {f"destination_{refund.pk}": refund for refund in refunds}
        for name, refund in self.refunds.items():
            offering = refund.purchase.offering
            self.fields[name] = forms.CharField(
                max_length=64,
                initial=refund.payer,
                label=f"{refund.purchase.ref}: "
                f"{amount_human(refund.amount, offering.asset_decimals)} {offering.asset_symbol} "
                f"on {refund.network}",
                help_text="The payer's wallet. Another one needs a second approver.",
            )


def approve_payouts_view(
    model_admin: Any, request: HttpRequest, queryset: QuerySet[Refund]
) -> HttpResponse | None:
    """The refund list's action: the form, then one payout per ticked refund."""
    if not model_admin.role_allows_action(request, "approve_payouts"):
        raise PermissionDenied
    owed = list(
        queryset.filter(state=Refund.State.OWED, method=Refund.Method.PAY_BACK)
        .select_related("purchase__offering")
        .order_by("pk")
    )
    if not owed:
        model_admin.message_user(request, "Tick owed chain refunds to pay out.", messages.WARNING)
        return None
    submitted = "apply" in request.POST
    form = ApprovePayoutsForm(request.POST if submitted else None, refunds=owed)
    if submitted and form.is_valid():
        destinations = {
            refund.pk: form.cleaned_data[name].strip() for name, refund in form.refunds.items()
        }
        batch = refunds_payout_approve(
            refund_ids=list(destinations),
            actor=Actor.staff(request.user.get_username()),
            destinations=destinations,
        )
        _tell(model_admin, request, batch.payouts, batch.refused)
        return None
    context = {
        **model_admin.admin_site.each_context(request),
        "title": "Pay out from the refund wallet",
        "opts": model_admin.opts,
        "form": form,
        "refunds": owed,
    }
    return TemplateResponse(request, "admin/payments/refund/approve_payouts.html", context)


def _tell(
    model_admin: Any,
    request: HttpRequest,
    payouts: list[Payout],
    refused: dict[int, PayoutRefused],
) -> None:
    recorded = [p for p in payouts if p.state == Payout.State.RECORDED]
    waiting = [p for p in payouts if p.state == Payout.State.AWAITING_APPROVAL]
    if recorded:
        model_admin.message_user(
            request,
            f"Approved {len(recorded)} payout(s): signed and recorded, pending until "
            "broadcast and final (see Payouts).",
            messages.SUCCESS,
        )
    if waiting:
        model_admin.message_user(
            request,
            f"{len(waiting)} payout(s) to another wallet than the payer's await a second "
            "approver (Payouts > Second approval).",
            messages.WARNING,
        )
    for refund_id, exc in refused.items():
        model_admin.message_user(
            request, f"Refund {refund_id}: {exc.code.value}: {exc.detail}", messages.ERROR
        )


@admin.register(Payout)
class PayoutAdmin(ReadOnlyModelAdmin):
    # Fits 1366 px beside the filters: the state is a filter and in the status's words; who
    # approved second and when are on the payout's page.
    list_display = (
        "pk",
        "refund",
        "destination",
        "amount_human",
        "status",
        "tx_hash",
        "approved_by",
    )
    list_filter = ("state", "network")
    list_select_related = ("refund__purchase__offering",)
    search_fields = ("=tx_hash", "=destination", "=refund__purchase__ref")
    readonly_fields = ("amount_human", "status")
    fields = (
        "refund",
        "network",
        "asset",
        "destination",
        "amount",
        "amount_human",
        "state",
        "status",
        "from_address",
        "nonce",
        "tx_hash",
        "raw_transaction",
        "approved_by",
        "approved_at",
        "second_approved_by",
        "second_approved_at",
        "cap_day",
        "broadcast_started_at",
        "broadcast_at",
        "broadcasts",
        "awaiting",
        "checked_at",
        "next_check_at",
        "evidence",
        "block_number",
        "confirmed_at",
        "reason_code",
        "created_at",
    )
    actions = ("approve_second_payout", "cancel_payout")

    @admin.display(description="amount")
    def amount_human(self, obj: Payout) -> str:
        offering = obj.refund.purchase.offering
        return f"{amount_human(obj.amount, offering.asset_decimals)} {offering.asset_symbol}"

    @admin.display(description="pending / paid")
    def status(self, obj: Payout) -> str:
        return payout_status(obj)

    def has_approve_second_permission(self, request: HttpRequest) -> bool:
        return self.role_allows_action(request, "approve_second_payout")

    @admin.action(description="Second approval (another wallet than the payer's)",
                  permissions=["approve_second"])  # fmt: skip
    def approve_second_payout(self, request: HttpRequest, queryset: QuerySet[Payout]) -> None:
        self._each_payout(request, queryset, payout_second_approve, "approved: signed, recorded.")

    @admin.action(description="Cancel (awaiting a second approver only)",
                  permissions=["approve_second"])  # fmt: skip
    def cancel_payout(self, request: HttpRequest, queryset: QuerySet[Payout]) -> None:
        self._each_payout(request, queryset, payout_cancel, "cancelled.")

    def _each_payout(
        self,
        request: HttpRequest,
        queryset: QuerySet[Payout],
        act: Callable[..., object],
        done: str,
    ) -> None:
        """`act` on each selected payout in turn; a refusal is said and the rest go on."""
        actor = Actor.staff(request.user.get_username())
        for payout in queryset.order_by("pk"):
            try:
                act(payout_id=payout.pk, actor=actor)
            except PayoutRefused as exc:
                self.message_user(
                    request, f"Payout {payout.pk}: {exc.code.value}: {exc.detail}", messages.ERROR
                )
                continue
            self.message_user(request, f"Payout {payout.pk} {done}", messages.SUCCESS)
