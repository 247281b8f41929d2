"""The back office: support's and finance's admin, at the top floor.

One rule: every app's admin lives here. Every change goes through a purchases service (which
writes the timeline), and every page is read beside its purchase, so the admin of payment
and fulfilment records lives here too, not in payments or fulfillment (which never import
purchases).
"""

from backoffice.admin import (
    catalog,
    evidence,
    finance,
    fulfillment,
    payments,
    payouts,
    purchases,
    refund_requests,
    webhooks,
)

__all__ = [
    "catalog",
    "evidence",
    "finance",
    "fulfillment",
    "payments",
    "payouts",
    "purchases",
    "refund_requests",
    "webhooks",
]
