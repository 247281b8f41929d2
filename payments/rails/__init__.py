"""Payment rails: one interface (`PaymentRail`), one module per rail, one line each in `RAILS`.

The purchases orchestration (purchases.services.checkout, purchases.services.settlement)
drives every rail through this interface and never names one.
"""

from payments.rails.base import Charge, PaymentRail, Presentation, QuoteTerms, rail_for
from payments.x402.types import (
    FIRST_BROADCAST,
    SETTLER_ANSWERS,
    SettlementOutcome,
    SettlementStatus,
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
