"""Payment rails: one interface (`PaymentRail`) and its outcome types, one home per rail
(payments.rails.prepaid; payments.rails.x402.rail beside the x402 machinery), one line each in
`RAILS`.

The purchases orchestration (purchases.services.checkout.checkout,
purchases.services.settle.settlement, purchases.services.jobs.reconcile) drives every rail through
this interface and never names one.
"""

from payments.rails.base import (
    FIRST_BROADCAST,
    REPLACED_SUBMISSION,
    SETTLER_ANSWERS,
    BatchLookup,
    Charge,
    FundsLow,
    PaymentRail,
    Presentation,
    QuoteTerms,
    RowGuard,
    SettlementOutcome,
    SettlementStatus,
    rail_for,
    rails,
    rails_settled_after_record,
)

__all__ = [
    "FIRST_BROADCAST",
    "REPLACED_SUBMISSION",
    "SETTLER_ANSWERS",
    "BatchLookup",
    "Charge",
    "FundsLow",
    "PaymentRail",
    "Presentation",
    "QuoteTerms",
    "RowGuard",
    "SettlementOutcome",
    "SettlementStatus",
    "rail_for",
    "rails",
    "rails_settled_after_record",
]
