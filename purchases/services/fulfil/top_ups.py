"""A top-up's work: crediting the buyer's prepaid balance, once, with its stored result.

Called by the execution's success transaction (execution._succeed_once), never on its own:
the ledger entry, the stored result and the purchase's move to succeeded commit together,
so a crash leaves either all of them or none, and the next run posts the credit then. The
entry's reference is the purchase's (`top_up:<purchase ref>`, unique), so even a second
success of one purchase could never post it twice. The purchase runs only once its payment
is settled at the network's confirmations (delivery_condition `settled`): a credit is never
made from a payment still pending.
"""

from __future__ import annotations

from core.canonical import canonical_json
from fulfillment.executors import JobOutput
from payments.models import LedgerEntry
from payments.services import ledger_balance, ledger_credit_once
from purchases.models import Purchase

TOP_UP_REFERENCE = "top_up:{ref}"


def top_up_credit(*, purchase: Purchase) -> JobOutput:
    """Credit the purchase's amount to its buyer's balance in its asset (once per purchase);
    the result the buyer gets: what was credited and the balance right after it.
    Caller holds the purchase's lock inside a transaction."""
    buyer_id = purchase.buyer_id or purchase.quote.buyer_id
    if buyer_id is None:  # pragma: no cover - top-up quotes are opened with an API key only
        raise RuntimeError(f"top-up {purchase.ref} has no buyer to credit")
    reference = TOP_UP_REFERENCE.format(ref=purchase.ref)
    entry, _ = ledger_credit_once(
        buyer_id=buyer_id,
        asset=purchase.asset,
        amount=purchase.amount,
        kind=LedgerEntry.Kind.TOP_UP,
        reference=reference,
        memo=f"x402 top-up paid by {purchase.payer}"[:200],
        purchase_id=purchase.pk,
    )
    balance = ledger_balance(buyer_id=buyer_id, asset=purchase.asset)
    document = {
        "top_up": {
            "purchase": purchase.ref,
            "credited": str(entry.amount),
            "asset": purchase.asset,
            "ledger_reference": reference,
            "balance": str(balance),
        }
    }
    return JobOutput(canonical_json(document).encode(), "application/json")
