"""Purchase list filters for support's queues: open escalation, refund owed, stuck, buyer,
payer wallet. Each is one indexed condition; the list stays a plain queryset."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from fulfillment.models import ExecutionAttempt
from payments.models import PaymentAttempt, Refund
from purchases.models import Escalation, Purchase

if TYPE_CHECKING:
    from django.contrib.admin.filters import _ListFilterChoices

PAY = Purchase.PaymentState
RUN = Purchase.FulfillmentState


def stuck_condition(now: datetime) -> tuple[Q, dict[str, Exists]]:
    """Not final and past its next check: a settlement whose look-up is overdue, work
    queued past the sweep grace, or running on a lease that expired."""
    overdue_look_up = PaymentAttempt.objects.filter(
        purchase=OuterRef("pk"),
        state__in=(PaymentAttempt.State.RECORDED, PaymentAttempt.State.SETTLEMENT_PENDING),
    ).filter(
        Q(next_check_at__lte=now)
        | Q(
            next_check_at__isnull=True,
            created_at__lte=now - settings.TOLLBOOTH["SETTLEMENT_GRACE"],
        )
    )
    dead_lease = ExecutionAttempt.objects.filter(
        purchase=OuterRef("pk"),
        state=ExecutionAttempt.State.RUNNING,
        lease_expires_at__lte=now,
    )
    sweep_cutoff = now - settings.TOLLBOOTH["SWEEP_GRACE"]
    return (
        Q(payment_state__in=(PAY.PAYING, PAY.SETTLEMENT_PENDING), look_up_overdue=True)
        | Q(fulfillment_state=RUN.QUEUED, updated_at__lte=sweep_cutoff)
        | Q(payment_state=PAY.PAID, fulfillment_state=RUN.NOT_STARTED, updated_at__lte=sweep_cutoff)
        | Q(fulfillment_state=RUN.RUNNING, lease_dead=True)
    ), {"look_up_overdue": Exists(overdue_look_up), "lease_dead": Exists(dead_lease)}


class _YesFilter(admin.SimpleListFilter):
    """A one-choice filter: "yes" narrows the list, no value leaves it whole."""

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "Yes")]

    def queryset(self, request: Any, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() != "yes":
            return queryset
        return self.narrow(queryset)

    def narrow(self, queryset: QuerySet[Any]) -> QuerySet[Any]:
        raise NotImplementedError


class OpenEscalationFilter(_YesFilter):
    title = "open escalation"
    parameter_name = "open_escalation"

    def narrow(self, queryset: QuerySet[Any]) -> QuerySet[Any]:
        open_ones = Escalation.objects.filter(purchase=OuterRef("pk"), state=Escalation.State.OPEN)
        return queryset.filter(Exists(open_ones))


class RefundOwedFilter(_YesFilter):
    title = "refund owed"
    parameter_name = "refund_owed"

    def narrow(self, queryset: QuerySet[Any]) -> QuerySet[Any]:
        owed = Refund.objects.filter(purchase=OuterRef("pk"), state=Refund.State.OWED)
        return queryset.filter(Exists(owed))


class StuckFilter(_YesFilter):
    title = "stuck (past its next check)"
    parameter_name = "stuck"

    def narrow(self, queryset: QuerySet[Any]) -> QuerySet[Any]:
        condition, annotations = stuck_condition(timezone.now())
        return queryset.alias(**annotations).filter(condition)


class _TextFilter(admin.SimpleListFilter):
    """A filter typed into a box (buyer ref, wallet): too many values to list as links."""

    template = "admin/purchases/text_filter.html"

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        # One entry so Django renders the filter; the template shows a text box instead.
        value = self.value() or ""
        return [(value, value)]

    def choices(self, changelist: ChangeList) -> Iterator[_ListFilterChoices]:
        yield {
            "selected": self.value() is not None,
            "query_string": changelist.get_query_string(remove=[str(self.parameter_name)]),
            "display": self.value() or "",
        }


class BuyerFilter(_TextFilter):
    title = "buyer (ref)"
    parameter_name = "buyer_ref"

    def queryset(self, request: Any, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = (self.value() or "").strip()
        return queryset.filter(buyer__ref=value) if value else queryset


class PayerWalletFilter(_TextFilter):
    title = "payer wallet"
    parameter_name = "payer_wallet"

    def queryset(self, request: Any, queryset: QuerySet[Any]) -> QuerySet[Any]:
        # Payers are stored lower-case; explorers show checksummed addresses.
        value = (self.value() or "").strip().lower()
        return queryset.filter(payer=value) if value else queryset


# --- escalations ---------------------------------------------------------------------------
ME, NOBODY = "__me__", "__none__"


class AssigneeFilter(admin.SimpleListFilter):
    """Escalations by the person working them: mine, nobody's yet, or a named colleague's."""

    title = "assigned to"
    parameter_name = "assignee"

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        people = (
            Escalation.objects.exclude(assignee="")
            .order_by("assignee")
            .values_list("assignee", flat=True)
            .distinct()[:50]
        )
        return [(ME, "Me"), (NOBODY, "Nobody yet"), *((p, p) for p in people)]

    def queryset(self, request: Any, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        if value == ME:
            return queryset.filter(assignee=request.user.get_username())
        return queryset.filter(assignee="" if value == NOBODY else value)
