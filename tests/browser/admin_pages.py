"""Every admin page support and finance use, as data: tests/browser/test_layout.py loads
each at 1366x768, one page load per case, on the rows admin_rows.py writes, and checks this
catalogue against the admin's registry, the role table and its URLs, so a new page cannot be
left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.urls import reverse

from backoffice.roles import FINANCE, SUPPORT
from fulfillment.models import ExecutionAttempt, Receipt, Result
from payments.models import (
    ExportBatch,
    LedgerBalance,
    LedgerEntry,
    PaymentAttempt,
    Payout,
    Refund,
)
from purchases.models import (
    Buyer,
    Escalation,
    IdempotencyRecord,
    JobRun,
    Offering,
    Purchase,
    Quote,
    RefundRequest,
)
from tests.browser.admin_rows import PAYER

BOTH = (SUPPORT, FINANCE)
S, F = (SUPPORT,), (FINANCE,)
CASE_ACTION = "admin:purchases_purchase_case_action"
PURCHASE = "admin:purchases_purchase_change"


@dataclass(frozen=True)
class AdminPage:
    """One page: its admin URL name, who opens it, the rows its URL names (by their name in
    the world, admin_rows.layout_world_build) and literal arguments, a query; for a list
    action's own page, the action run on the list's rows."""

    name: str
    url_name: str
    roles: tuple[str, ...]
    rows: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    query: str = ""
    action: str = ""

    def url(self, pks: dict[str, int]) -> str:
        return reverse(self.url_name, args=[*(pks[r] for r in self.rows), *self.args]) + self.query


def _model_pages(model: type[Any], row: str, roles: tuple[str, ...]) -> list[AdminPage]:
    """The list, one row's page and its history, for the roles that see the model."""
    label = model._meta.verbose_name_plural
    prefix = f"admin:{model._meta.app_label}_{model._meta.model_name}"
    return [
        AdminPage(f"{label} list", f"{prefix}_changelist", roles),
        AdminPage(f"{label}: {row}", f"{prefix}_change", roles, (row,)),
        AdminPage(f"{label}: {row} history", f"{prefix}_history", roles, (row,)),
    ]


PAGES: list[AdminPage] = [
    AdminPage("index", "admin:index", BOTH),
    AdminPage("purchases app", "admin:app_list", BOTH, args=("purchases",)),
    AdminPage("payments app", "admin:app_list", BOTH, args=("payments",)),
    AdminPage("fulfillment app", "admin:app_list", S, args=("fulfillment",)),
    AdminPage("password change", "admin:password_change", BOTH),
    AdminPage("dashboard", "admin:purchases_purchase_dashboard", BOTH),
    # The purchase: the list (and searched, filtered), a case file per shape of case, the
    # case actions that ask for input.
    *_model_pages(Purchase, "late transfer", BOTH),
    AdminPage("purchases list, searched and filtered", "admin:purchases_purchase_changelist", S,
              query=f"?q={PAYER}&refund_owed=yes"),
    AdminPage("purchases: settled", PURCHASE, BOTH, ("settled",)),
    AdminPage("purchases: duplicate transfer", PURCHASE, BOTH, ("duplicate transfer",)),
    AdminPage("purchases: prepaid", PURCHASE, BOTH, ("prepaid",)),
    AdminPage("case action: assign", CASE_ACTION, S, ("late transfer",), ("assign",)),
    AdminPage("case action: resolve", CASE_ACTION, S, ("late transfer",), ("resolve",)),
    AdminPage("case action: propose refund", CASE_ACTION, S, ("settled",), ("propose_refund",)),
    AdminPage("case action: approve refund", CASE_ACTION, F, ("duplicate transfer",),
              ("approve_refund",)),
    # Escalations, resolved one at a time or ticked on the list.
    *_model_pages(Escalation, "open", S),
    AdminPage("escalations: resolve", "admin:purchases_escalation_resolve", S, ("open",)),
    AdminPage("escalations: resolve selected", "admin:purchases_escalation_changelist", S,
              action="resolve_selected"),
    # Buyers' refund requests: the queue, a request beside its case, support's decision.
    *_model_pages(RefundRequest, "refund request", BOTH),
    AdminPage("refund requests: decide", "admin:purchases_refundrequest_decide", S,
              ("refund request",)),
    # Finance's money: refunds owed (the list opens there), all refunds, paying back.
    *_model_pages(Refund, "paid back", BOTH),
    AdminPage("refunds list, all", "admin:payments_refund_changelist", BOTH, query="?state=all"),
    AdminPage("refunds: mark paid back", "admin:payments_refund_changelist", F,
              action="mark_paid_back"),
    AdminPage("refunds: approve payouts", "admin:payments_refund_changelist", F,
              action="approve_payouts"),
    *_model_pages(Payout, "payout", BOTH),
    *_model_pages(LedgerEntry, "top-up", BOTH),
    AdminPage("ledger entries: top up", "admin:payments_ledgerentry_top_up", F),
    *_model_pages(LedgerBalance, "balance", BOTH),
    *_model_pages(ExportBatch, "export", F),
    AdminPage("export batches: a period's books", "admin:payments_exportbatch_books", F),
    *_model_pages(PaymentAttempt, "late attempt", BOTH),
    # Support's evidence.
    *_model_pages(Quote, "quote", S),
    *_model_pages(IdempotencyRecord, "payment id", S),
    *_model_pages(JobRun, "job run", S),
    *_model_pages(ExecutionAttempt, "execution", S),
    *_model_pages(Result, "result", S),
    *_model_pages(Receipt, "receipt", S),
    *_model_pages(Offering, "offering", S),
    *_model_pages(Buyer, "buyer", S),
]  # fmt: skip
