"""The signal a stored result sends to the requests waiting for it (see result_wait)."""

from __future__ import annotations

from django.db import connection

FULFILLMENT_CHANNEL = "tollbooth_fulfillment"


def fulfillment_notify(*, purchase_id: int) -> None:
    """Tell waiting requests this purchase's fulfilment moved. Call inside the transaction
    that moves it: PostgreSQL delivers the notification only if and when it commits."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [FULFILLMENT_CHANNEL, str(purchase_id)])
