"""Which timeline events are webhook events, and recording them in the change's transaction.

purchases.events calls `webhook_event_listen` for every event it records. Most are not
webhook events (a dict look-up says so). One that is, while an enabled endpoint subscribes
to its type, costs two INSERTs in the caller's transaction: the WebhookEvent (its per-purchase
sequence, unique, taken in a savepoint) and its outbox message. The
message is not sent after the commit (no broker call on the purchase's path): the relay loop
sends it within seconds. Which types are subscribed is read at most every
SUBSCRIPTIONS_TTL seconds per process (at once in the process that saved an endpoint), so a
purchase's path adds no statement while nobody subscribes.
"""

from __future__ import annotations

import time
from datetime import datetime

from django.db import IntegrityError, transaction
from django.db.models import Max, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from purchases import event_subjects as subjects
from purchases.models import Purchase, PurchaseEvent
from purchases.services.shared.outbox import outbox_stage_many
from webhooks.models import WebhookEndpoint, WebhookEvent

PUBLISH_JOB = "webhook_event_publish"
# Another process's endpoint change reaches this one's purchases within this long.
SUBSCRIPTIONS_TTL = 10.0
_ALL = "*"
# Each lost race is one event of the same purchase committed meanwhile: a few at most.
SEQUENCE_TRIES = 5

# (timeline subject, state moved to) -> webhook event type.
EVENT_TYPE_OF: dict[tuple[str, str], str] = {
    (subjects.PURCHASE_PAYMENT, Purchase.PaymentState.PAID): "purchase.paid",
    (subjects.PURCHASE_PAYMENT, Purchase.PaymentState.FAILED): "purchase.failed",
    (subjects.PURCHASE_FULFILLMENT, Purchase.FulfillmentState.SUCCEEDED): "purchase.succeeded",
    (subjects.PURCHASE_FULFILLMENT, Purchase.FulfillmentState.FAILED): "purchase.failed",
    (subjects.PURCHASE_FULFILLMENT, Purchase.FulfillmentState.UNKNOWN): (
        "purchase.outcome_unknown"
    ),
    (subjects.ESCALATION, "open"): "purchase.escalated",
    (subjects.ESCALATION, "resolved"): "purchase.resolved",
    (subjects.REFUND, "proposed"): "refund.proposed",
    (subjects.REFUND, "owed"): "refund.owed",
    (subjects.REFUND, "paid"): "refund.paid",
    (subjects.REFUND, "declined"): "refund.declined",
    (subjects.PAYOUT_BROADCAST, "broadcast"): "payout.sent",
    (subjects.PAYOUT, "failed"): "payout.failed",
    (subjects.REFUND_REQUEST, "open"): "refund_request.opened",
    (subjects.REFUND_REQUEST, "approved"): "refund_request.decided",
    (subjects.REFUND_REQUEST, "denied"): "refund_request.decided",
}
# A reorg is a boundary event, not a move: any to_state.
_TYPE_OF_SUBJECT = {subjects.PAYMENT_REORGED: "settlement.reorged"}

# (read at, monotonic; the types enabled endpoints subscribe to, "*" for every type)
_snapshot: tuple[float, frozenset[str]] | None = None


def event_type_of(subject: str, to_state: str) -> str | None:
    return EVENT_TYPE_OF.get((subject, str(to_state))) or _TYPE_OF_SUBJECT.get(subject)


def subscriptions_forget() -> None:
    """Read the subscriptions again on the next event (an endpoint changed here)."""
    global _snapshot
    _snapshot = None


def endpoint_changed(**_: object) -> None:
    """post_save / post_delete of an endpoint: this process reads the subscriptions again."""
    subscriptions_forget()


def subscriptions_set(types: frozenset[str]) -> None:
    """Take `types` as the subscriptions for the next SUBSCRIPTIONS_TTL seconds (tests start
    from a process that read them already, as a running server has)."""
    global _snapshot
    _snapshot = (time.monotonic(), types)


def _subscribed(event_type: str) -> bool:
    global _snapshot
    if _snapshot is None or time.monotonic() - _snapshot[0] > SUBSCRIPTIONS_TTL:
        types: set[str] = set()
        for listed in WebhookEndpoint.objects.filter(enabled=True).values_list(
            "event_types", flat=True
        ):
            types.update(listed or [_ALL])
        _snapshot = (time.monotonic(), frozenset(types))
    return event_type in _snapshot[1] or _ALL in _snapshot[1]


def webhook_event_listen(event: PurchaseEvent) -> None:
    """The timeline's listener: record `event` as a webhook event if it is one and someone
    subscribes to its type. Runs in the transaction of the change."""
    event_type = event_type_of(event.subject, event.to_state)
    if event_type is None or event.purchase_id is None or not _subscribed(event_type):
        return
    webhook_event_record(
        purchase_id=event.purchase_id,
        event_type=event_type,
        reason_code=event.reason_code,
        now=timezone.now(),
    )


def webhook_event_record(
    *, purchase_id: int, event_type: str, reason_code: str, now: datetime
) -> WebhookEvent:
    """Write the event and stage its publication, in the caller's transaction: its sequence
    is the purchase's last plus one. A racing event of the same purchase (recorded without
    the purchase's lock) makes our INSERT wait for its commit and fail on the unique
    sequence: taken again, in a savepoint, so the caller's transaction goes on."""
    last = (
        WebhookEvent.objects.filter(purchase_id=purchase_id)
        .values("purchase_id")
        .annotate(last=Max("sequence"))
        .values("last")
    )
    for tries_left in range(SEQUENCE_TRIES - 1, -1, -1):
        event = WebhookEvent(
            purchase_id=purchase_id,
            type=event_type,
            reason_code=reason_code or "",
            occurred_at=now,
            sequence=Coalesce(Subquery(last), 0) + 1,
        )
        try:
            with transaction.atomic():
                event.save()
            break
        except IntegrityError:
            if not tries_left:
                raise
    outbox_stage_many(
        job=PUBLISH_JOB,
        messages=[({"event_id": event.pk}, f"webhook:{event.public_id}")],
        now=now,
    )
    return event
