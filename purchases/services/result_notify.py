"""The signal a stored result sends to the requests waiting for it (see result_wait)."""

from __future__ import annotations

from django.db import connection

from payments.models import Rail
from purchases.models import Purchase

FULFILLMENT_CHANNEL = "tollbooth_fulfillment"


def fulfillment_notify(*, purchase: Purchase) -> None:
    """Tell waiting requests this purchase's fulfilment moved. Call inside the transaction
    that moves it: PostgreSQL delivers the notification only if and when it commits.

    Only x402 paid requests wait for their result in the request, so other rails send
    nothing (a statement saved on every prepaid execution)."""
    if connection.vendor == "postgresql" and purchase.rail == Rail.X402:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [FULFILLMENT_CHANNEL, str(purchase.pk)])
