"""Celery interfaces of the webhooks: parse ids, make one domain call."""

from __future__ import annotations

from celery import shared_task

from webhooks.services import (
    webhook_deliveries_prune,
    webhook_deliveries_send_due,
    webhook_delivery_attempt,
    webhook_event_publish,
    webhook_failing_alert,
)


# A lost run is harmless: its deliveries are pending and the due sweep tries them.
@shared_task(acks_late=True, soft_time_limit=300, time_limit=330)
def webhook_event_publish_task(*, event_id: int) -> int:
    return len(webhook_event_publish(event_id=event_id))


@shared_task(acks_late=True, soft_time_limit=60, time_limit=90)
def webhook_delivery_attempt_task(*, delivery_id: int) -> str:
    return webhook_delivery_attempt(delivery_id=delivery_id)


@shared_task(acks_late=True, soft_time_limit=300, time_limit=330)
def webhook_deliveries_due_task() -> int:
    return webhook_deliveries_send_due()


@shared_task(acks_late=True, soft_time_limit=120, time_limit=150)
def webhook_failing_alert_task() -> int:
    return webhook_failing_alert()


@shared_task(acks_late=True, soft_time_limit=600, time_limit=660)
def webhook_deliveries_prune_task() -> int:
    return webhook_deliveries_prune()
