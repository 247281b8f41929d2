"""The signal a stored result sends to the requests waiting for it (see result_wait)."""

from __future__ import annotations

from payments.models import Rail
from purchases.models import Purchase
from purchases.sql import fulfillment_notify_send


def fulfillment_notify(*, purchase: Purchase) -> None:
    """Tell waiting requests this purchase's fulfilment moved. Call inside the transaction
    that moves it: PostgreSQL delivers the notification only if and when it commits.

    Only x402 paid requests wait for their result in the request, so other rails send
    nothing (a statement saved on every prepaid execution)."""
    if purchase.rail == Rail.X402:
        fulfillment_notify_send(purchase_id=purchase.pk)
