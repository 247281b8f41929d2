"""Payment rails: one interface (`PaymentRail`) and its outcome types, one home per rail
(payments.rails.prepaid; payments.x402.rail beside the x402 machinery), one line each in
`RAILS`.

The purchases orchestration (purchases.services.checkout, purchases.services.settlement)
drives every rail through this interface and never names one.
"""

from payments.rails.base import (
    FIRST_BROADCAST,
    SETTLER_ANSWERS,
    Charge,
    PaymentRail,
    Presentation,
    QuoteTerms,
    SettlementOutcome,
    SettlementStatus,
    rail_for,
)

__all__ = [
    "FIRST_BROADCAST",
    "SETTLER_ANSWERS",
    "Charge",
    "PaymentRail",
    "Presentation",
    "QuoteTerms",
    "SettlementOutcome",
    "SettlementStatus",
    "rail_for",
]
