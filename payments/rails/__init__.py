"""Payment rails: one interface (`PaymentRail`), one module per rail, one line each in `RAILS`.

The purchases orchestration (purchases.services.checkout, purchases.services.settlement)
drives every rail through this interface and never names one.
"""

from payments.rails.base import Charge, PaymentRail, Presentation, QuoteTerms, rail_for
from payments.x402.types import SettlementOutcome, SettlementStatus

__all__ = [
    "Charge",
    "PaymentRail",
    "Presentation",
    "QuoteTerms",
    "SettlementOutcome",
    "SettlementStatus",
    "rail_for",
]
