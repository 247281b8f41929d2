"""Publishing webhook events and delivering them, at least once, from the worker.

Phases, as everywhere (docs/architecture.md): decide and record, commit, call out with a
bounded timeout and no transaction or lock open, then lock, re-check and record the outcome.
A purchase's path only writes the event (webhooks.events); every POST happens here, in a
Celery worker, so a slow or dead endpoint never slows a purchase. Endpoints are sent to in
lanes, one thread each, and one lane at a time per endpoint (`lane_until`), so a slow or
dead endpoint holds one thread, never the others' deliveries. Every POST goes through the
URL guard (webhooks.urlguard).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, connections, transaction
from django.db.models import Q
from django.utils import timezone

from core.backoff import backoff_delay
from core.clock import now_or
from purchases.models import Purchase
from purchases.notify import Alert, AlertNotDelivered, alert_send_report
from purchases.refund_request_selectors import refund_request_document, refund_request_latest
from purchases.selectors import purchase_status
from purchases.services.shared.outbox import outbox_stage
from webhooks.events import PUBLISH_JOB, subscriptions_forget, webhook_event_record
from webhooks.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookEvent
from webhooks.signing import HEADER, callback_secret, signature_header
from webhooks.urlguard import guarded_post

logger = logging.getLogger(__name__)

ATTEMPT_JOB = "webhook_delivery_attempt"
# Retried for this long from the first try (a replay starts a new window).
RETRY_WINDOW = timedelta(days=3)
# Backoff before try n+1: 30 s x 2^(n-1), at most 6 h, times a jitter in [0.5, 1.0), so
# endpoints that failed together are not all retried in the same second: about 20 tries in
# the 3 days, the last at the window's end.
BACKOFF_BASE_SECONDS = 30.0
BACKOFF_CAP_SECONDS = 6 * 3600.0
# What we keep of an endpoint's answer: enough to read an error page's first lines.
RESPONSE_EXCERPT = 1_000
# A claimed delivery is invisible to other sweeps this long past its timeout.
CLAIM_MARGIN = timedelta(seconds=30)
DUE_BATCH = 100
PRUNE_BATCH = 1_000
# An event not published this long after it was written lost its job (the broker lost it,
# or its worker died mid-run): the due sweep publishes it. Far above the relay's seconds.
PUBLISH_GRACE = timedelta(minutes=5)
# An endpoint failing this long (no 2xx since its first failed try) is told to a person.
FAILING_ALERT_AFTER = timedelta(hours=1)


class Outcome:
    DELIVERED = "delivered"
    RETRY = "retry"
    FAILED = "failed"
    GONE = "endpoint_gone"
    SKIPPED = "skipped"


def _timeouts() -> tuple[float, float]:
    return (
        settings.WEBHOOKS["CONNECT_TIMEOUT_SECONDS"],
        settings.WEBHOOKS["READ_TIMEOUT_SECONDS"],
    )


def backoff(attempts: int, rng: random.Random | None = None) -> timedelta:
    """How long after the `attempts`-th failed try the next one is due."""
    return backoff_delay(
        attempts,
        base_seconds=BACKOFF_BASE_SECONDS,
        cap_seconds=BACKOFF_CAP_SECONDS,
        jitter=(0.5, 1.0),
        rng=rng,
    )


def event_payload(event: WebhookEvent) -> bytes:
    """The bytes every delivery of `event` sends (and signs): the same on every retry."""
    return json.dumps(
        {
            "id": event.public_id,
            "type": event.type,
            "created_at": event.occurred_at.isoformat(),
            "purchase": event.body.get("purchase") if event.body else None,
            "sequence": event.sequence,
            "data": event.body,
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()


# -- publishing ---------------------------------------------------------------------------


def webhook_event_publish(*, event_id: int, now: datetime | None = None) -> list[int]:
    """Freeze the event's body (the purchase's API document) and give it one delivery per
    enabled endpoint subscribing to its type (a callback URL: only for its buyer's
    purchases); then send to each endpoint's lane at once. Retry-safe: a second run adds only
    the deliveries missing. Returns the delivery ids."""
    delivery_ids = _publish_only(event_id, now_or(now))
    endpoint_ids = WebhookDelivery.objects.filter(pk__in=delivery_ids).values_list(
        "endpoint_id", flat=True
    )
    _lanes_run(sorted(set(endpoint_ids)), now)
    return delivery_ids


def _publish_only(event_id: int, now: datetime) -> list[int]:
    """Freeze the body and write the missing deliveries (due now); their pending ids."""
    with transaction.atomic():
        event = WebhookEvent.objects.select_for_update().get(pk=event_id)
        if event.body is None:
            event.body = _body_of(event, now)
            event.published_at = now
            event.save(update_fields=["body", "published_at"])
        endpoints = WebhookEndpoint.objects.filter(enabled=True)
        if event.only_endpoint_id is not None:
            endpoints = endpoints.filter(pk=event.only_endpoint_id)
        else:
            endpoints = endpoints.filter(_hears_of(event))
        WebhookDelivery.objects.bulk_create(
            [
                WebhookDelivery(
                    endpoint=endpoint, event=event, next_attempt_at=now, window_started_at=now
                )
                for endpoint in endpoints
                if endpoint.subscribes_to(event.type) or event.only_endpoint_id is not None
            ],
            ignore_conflicts=True,
        )
        delivery_ids = list(
            WebhookDelivery.objects.filter(event=event, state=WebhookDelivery.State.PENDING)
            .order_by("pk")
            .values_list("pk", flat=True)
        )
    return delivery_ids


def _hears_of(event: WebhookEvent) -> Q:
    """The admins' endpoints hear of every purchase; a callback URL of its buyer's only, and
    not once its API key is revoked."""
    buyer_id = event.purchase.buyer_id if event.purchase is not None else None
    if buyer_id is None:
        return Q(api_key__isnull=True)
    return Q(api_key__isnull=True) | Q(api_key__buyer_id=buyer_id, api_key__revoked_at__isnull=True)


def _body_of(event: WebhookEvent, now: datetime) -> dict[str, Any]:
    if event.purchase_id is None:
        return {"test": True, "message": "A test event from the Tollbooth admin."}
    purchase = Purchase.objects.select_related("quote", "offering").get(pk=event.purchase_id)
    body = purchase_status(purchase=purchase, now=now)
    if event.type.startswith("refund_request."):
        # One open request per purchase: the latest is the one the event reports.
        latest = refund_request_latest(purchase=purchase)
        body["refund_request"] = refund_request_document(request=latest) if latest else None
    return body


def webhook_test_send(*, endpoint_id: int, now: datetime | None = None) -> WebhookEvent:
    """Send a `webhook.test` event to this endpoint only, through the outbox."""
    now = now_or(now)
    with transaction.atomic():
        event = WebhookEvent.objects.create(
            type="webhook.test", occurred_at=now, only_endpoint_id=endpoint_id
        )
        outbox_stage(job=PUBLISH_JOB, kwargs={"event_id": event.pk}, now=now)
    return event


# -- delivering ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Claimed:
    url: str
    keys: list[tuple[str, bytes]] | None
    payload: bytes
    headers: dict[str, str]


def webhook_delivery_attempt(
    *, delivery_id: int, now: datetime | None = None, rng: random.Random | None = None
) -> str:
    """Try one due delivery once: POST it signed, with a bounded timeout, and record the
    attempt (2xx: delivered; 410: the endpoint is disabled; otherwise the next try after a
    backoff, or failed at the retry window's end). Returns an Outcome value; `skipped` when
    the delivery is not due, not pending, or its endpoint is disabled."""
    now = now_or(now)
    claimed = _claim(delivery_id, now)
    if claimed is None:
        return Outcome.SKIPPED
    started = time.monotonic()
    status, excerpt, error = _post(claimed)
    latency_ms = int((time.monotonic() - started) * 1000)
    return _record(delivery_id, now, status, excerpt, error, latency_ms, rng)


def _claim(delivery_id: int, now: datetime) -> _Claimed | None:
    with transaction.atomic():
        delivery = (
            WebhookDelivery.objects.select_for_update(of=("self",))
            .select_related("endpoint", "event")
            .filter(pk=delivery_id)
            .first()
        )
        if (
            delivery is None
            or delivery.state != WebhookDelivery.State.PENDING
            or not delivery.endpoint.enabled
            or (delivery.next_attempt_at is not None and delivery.next_attempt_at > now)
        ):
            return None
        delivery.next_attempt_at = now + timedelta(seconds=sum(_timeouts())) + CLAIM_MARGIN
        delivery.save(update_fields=["next_attempt_at"])
    endpoint, event = delivery.endpoint, delivery.event
    payload = event_payload(event)
    keys = _keys(endpoint)
    timestamp = int(now.timestamp())
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "Tollbooth-Webhooks/1",
        "Tollbooth-Event-Id": event.public_id,
        "Tollbooth-Event-Type": event.type,
    }
    if keys:
        headers[HEADER] = signature_header(keys=keys, timestamp=timestamp, body=payload)
    return _Claimed(url=endpoint.url, keys=keys, payload=payload, headers=headers)


def _keys(endpoint: WebhookEndpoint) -> list[tuple[str, bytes]] | None:
    """(key id, secret), the current first; None when the current secret is not set (never
    send unsigned)."""
    if endpoint.api_key_id is not None:
        return [(endpoint.key_id, callback_secret(endpoint.secret_salt).encode())]
    current = os.environ.get(endpoint.secret_env, "") if endpoint.secret_env else ""
    if not current:
        return None
    keys = [(endpoint.key_id, current.encode())]
    previous = (
        os.environ.get(endpoint.previous_secret_env, "") if endpoint.previous_secret_env else ""
    )
    if previous and endpoint.previous_key_id:
        keys.append((endpoint.previous_key_id, previous.encode()))
    return keys


def _post(claimed: _Claimed) -> tuple[int | None, str, str]:
    """(status, excerpt of the answer, error): never raises."""
    if claimed.keys is None:
        return None, "", "secret_missing"
    # The guard checks the URL again at send time (a row written around the form, or before
    # production's settings applied, never goes out in clear) and resolves its host now.
    connect_timeout, read_timeout = _timeouts()
    try:
        answer = guarded_post(
            claimed.url,
            body=claimed.payload,
            headers=claimed.headers,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_bytes=RESPONSE_EXCERPT * 4,  # UTF-8: at most 4 bytes a character
        )
        text = answer.excerpt.decode("utf-8", "replace")[:RESPONSE_EXCERPT]
        return answer.status, text, answer.error
    except Exception as exc:  # any other failure is one failed try, never a crashed task
        logger.warning("webhook delivery %s: %r", claimed.url, exc)
        return None, "", type(exc).__name__[:200]


def _record(
    delivery_id: int,
    now: datetime,
    status: int | None,
    excerpt: str,
    error: str,
    latency_ms: int,
    rng: random.Random | None,
) -> str:
    with transaction.atomic():
        delivery = (
            WebhookDelivery.objects.select_for_update(of=("self",))
            .select_related("endpoint")
            .get(pk=delivery_id)
        )
        WebhookAttempt.objects.create(
            delivery=delivery,
            attempted_at=now,
            status_code=status,
            latency_ms=latency_ms,
            response_excerpt=excerpt,
            error=error,
        )
        delivery.attempts += 1
        delivery.last_status = status
        outcome = _decide(delivery, now, status, rng)
        delivery.save(
            update_fields=[
                "state",
                "attempts",
                "last_status",
                "next_attempt_at",
                "delivered_at",
                "failure_reason",
            ]
        )
    return outcome


def _decide(delivery: WebhookDelivery, now: datetime, status: int | None, rng: Any) -> str:
    if delivery.state != WebhookDelivery.State.PENDING:
        return Outcome.SKIPPED  # settled meanwhile (a replay raced us): the attempt is noted
    if status is not None and 200 <= status < 300:
        delivery.deliver(at=now, status=status)
        WebhookEndpoint.objects.filter(pk=delivery.endpoint_id, failing_since__isnull=False).update(
            failing_since=None, failing_alerted_at=None
        )
        return Outcome.DELIVERED
    WebhookEndpoint.objects.filter(pk=delivery.endpoint_id, failing_since__isnull=True).update(
        failing_since=now
    )
    if status == 410:
        delivery.fail(reason="endpoint_gone")
        _disable(delivery.endpoint, reason="endpoint_gone", now=now)
        return Outcome.GONE
    window_ends_at = delivery.window_started_at + RETRY_WINDOW
    if now >= window_ends_at:
        delivery.fail(reason="retries_exhausted")
        return Outcome.FAILED
    delivery.next_attempt_at = min(now + backoff(delivery.attempts, rng), window_ends_at)
    return Outcome.RETRY


def webhook_deliveries_send_due(*, now: datetime | None = None, limit: int = DUE_BATCH) -> int:
    """The beat sweep: publish the events whose publication was lost (past PUBLISH_GRACE),
    then send every enabled endpoint's due deliveries, the endpoints in lanes side by side
    (at most `limit` a lane per pass). Returns how many deliveries it tried."""
    _publish_lost(now_or(now), limit)
    endpoint_ids = (
        WebhookDelivery.objects.filter(
            state=WebhookDelivery.State.PENDING,
            next_attempt_at__lte=now_or(now),
            endpoint__enabled=True,
        )
        .order_by()
        .values_list("endpoint_id", flat=True)
        .distinct()
    )
    return _lanes_run(sorted(endpoint_ids), now, limit)


# -- lanes: one thread per endpoint, one lane per endpoint at a time ------------------------


def _lanes_run(endpoint_ids: list[int], now: datetime | None, limit: int = DUE_BATCH) -> int:
    """Send each endpoint's due deliveries, the endpoints side by side (at most LANES
    threads). Inside a transaction (tests), one after another in this thread: other threads
    would not see its rows. Returns how many deliveries were tried."""
    if not endpoint_ids:
        return 0
    if len(endpoint_ids) == 1 or connection.in_atomic_block:
        return sum(_lane(endpoint_id, now, limit) for endpoint_id in endpoint_ids)
    workers = min(len(endpoint_ids), settings.WEBHOOKS["LANES"])
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="webhook-lane") as pool:
        return sum(pool.map(lambda eid: _lane_in_thread(eid, now, limit), endpoint_ids))


def _lane_in_thread(endpoint_id: int, now: datetime | None, limit: int) -> int:
    try:
        return _lane(endpoint_id, now, limit)
    except Exception:  # one endpoint's trouble never stops the other lanes
        logger.exception("webhook lane of endpoint %s failed; the next sweep retries", endpoint_id)
        return 0
    finally:
        connections.close_all()  # this thread's own connection


def _lane(endpoint_id: int, now: datetime | None, limit: int) -> int:
    """Take the endpoint's lane (skip it when another sweep holds it: that one sends what is
    due) and send its due deliveries, oldest first, for at most LANE_BUDGET_SECONDS. With a
    fixed `now` (tests), one pass."""
    budget = settings.WEBHOOKS["LANE_BUDGET_SECONDS"]
    tried, deadline = 0, time.monotonic() + budget
    while time.monotonic() < deadline:
        held_until = timezone.now() + timedelta(seconds=budget + sum(_timeouts())) + CLAIM_MARGIN
        free = Q(lane_until__isnull=True) | Q(lane_until__lte=timezone.now())
        if not WebhookEndpoint.objects.filter(free, pk=endpoint_id).update(lane_until=held_until):
            return tried
        try:
            tried += _lane_drain(endpoint_id, now, limit, deadline)
        finally:
            WebhookEndpoint.objects.filter(pk=endpoint_id, lane_until=held_until).update(
                lane_until=None
            )
        # A delivery written after our last look, whose sender found the lane still ours,
        # is ours to send: look once more after letting go.
        if now is not None or not _due(endpoint_id, now_or(now), 1):
            break
    return tried


def _due(endpoint_id: int, at: datetime, limit: int) -> list[int]:
    return list(
        WebhookDelivery.objects.filter(
            endpoint_id=endpoint_id, state=WebhookDelivery.State.PENDING, next_attempt_at__lte=at
        )
        .order_by("next_attempt_at", "pk")
        .values_list("pk", flat=True)[:limit]
    )


def _lane_drain(endpoint_id: int, now: datetime | None, limit: int, deadline: float) -> int:
    tried = 0
    while time.monotonic() < deadline:
        at = now_or(now)
        due = _due(endpoint_id, at, limit)
        for delivery_id in due:
            if time.monotonic() >= deadline:
                break
            if webhook_delivery_attempt(delivery_id=delivery_id, now=at) != Outcome.SKIPPED:
                tried += 1
        if not due or now is not None:
            break
    return tried


def webhook_deliveries_prune(*, now: datetime | None = None, batch: int = PRUNE_BATCH) -> int:
    """Delete the deliveries delivered more than DELIVERED_RETENTION_DAYS ago, with their
    attempts, in batches. Events stay (they hold each purchase's last sequence, and are
    small); failed and pending deliveries stay for a person. Returns how many were deleted."""
    cutoff = now_or(now) - timedelta(days=settings.WEBHOOKS["DELIVERED_RETENTION_DAYS"])
    deleted = 0
    while True:
        ids = list(
            WebhookDelivery.objects.filter(
                state=WebhookDelivery.State.DELIVERED, delivered_at__lt=cutoff
            ).values_list("pk", flat=True)[:batch]
        )
        if not ids:
            return deleted
        with transaction.atomic():
            WebhookAttempt.objects.filter(delivery_id__in=ids).delete()
            WebhookDelivery.objects.filter(pk__in=ids).delete()
        deleted += len(ids)


def _publish_lost(now: datetime, limit: int) -> None:
    lost = WebhookEvent.objects.filter(
        published_at__isnull=True, occurred_at__lte=now - PUBLISH_GRACE
    ).order_by("occurred_at", "pk")
    for event_id in list(lost.values_list("pk", flat=True)[:limit]):
        try:
            # Its body is the purchase as it stands now; its deliveries are tried below.
            _publish_only(event_id, now)
        except Exception:  # one event that cannot be published never stops the sweep
            logger.exception("webhook event %s not published; the next sweep retries", event_id)


def webhook_delivery_replay(*, delivery_id: int, now: datetime | None = None) -> WebhookDelivery:
    """Send the delivery again (whatever its state), with a new retry window, through the
    outbox."""
    now = now_or(now)
    with transaction.atomic():
        delivery = WebhookDelivery.objects.select_for_update().get(pk=delivery_id)
        delivery.replay(at=now)
        delivery.save(
            update_fields=["state", "failure_reason", "next_attempt_at", "window_started_at"]
        )
        outbox_stage(
            job=ATTEMPT_JOB,
            kwargs={"delivery_id": delivery.pk},
            dedup_key=f"webhook-delivery:{delivery.pk}",
            now=now,
        )
    return delivery


# -- telling a person --------------------------------------------------------------------


def webhook_failing_alert(*, now: datetime | None = None) -> int:
    """Tell a person, once per failing spell, of each enabled endpoint that has answered no
    2xx for FAILING_ALERT_AFTER. Claimed by a conditional UPDATE (two sweeps never both
    send), given back when no backend delivered (the next sweep retries). Returns how many
    were told."""
    now = now_or(now)
    told = 0
    due = WebhookEndpoint.objects.filter(
        enabled=True, failing_since__lte=now - FAILING_ALERT_AFTER, failing_alerted_at__isnull=True
    ).values_list("pk", flat=True)
    for endpoint_id in list(due):
        claimed = WebhookEndpoint.objects.filter(
            pk=endpoint_id, failing_alerted_at__isnull=True
        ).update(failing_alerted_at=now)
        if not claimed:
            continue
        endpoint = WebhookEndpoint.objects.get(pk=endpoint_id)
        try:
            alert_send_report(_failing_alert(endpoint, now))
        except AlertNotDelivered:
            logger.exception("webhook endpoint %s failing: alert not delivered", endpoint_id)
            WebhookEndpoint.objects.filter(pk=endpoint_id).update(failing_alerted_at=None)
            continue
        told += 1
    return told


def _failing_alert(endpoint: WebhookEndpoint, now: datetime) -> Alert:
    pending = endpoint.deliveries.filter(state=WebhookDelivery.State.PENDING)
    last = WebhookAttempt.objects.filter(delivery__endpoint=endpoint).first()
    since = endpoint.failing_since or now
    return Alert(
        kind="webhook_endpoint_failing",
        title=f"Webhook endpoint failing for {int((now - since).total_seconds() // 60)} min",
        message=(
            f"{endpoint.url} has answered no 2xx since {since:%Y-%m-%d %H:%M} UTC; "
            f"{pending.count()} deliveries wait and are retried for 3 days. "
            "See the admin (Webhook endpoints)."
        ),
        details={
            "endpoint": endpoint.pk,
            "url": endpoint.url,
            "last_status": last.status_code if last else None,
            "last_error": last.error if last else "",
        },
        idempotency_key=f"tollbooth-webhook-failing-{endpoint.pk}-{int(since.timestamp())}",
    )


# -- endpoints ----------------------------------------------------------------------------


def _disable(endpoint: WebhookEndpoint, *, reason: str, now: datetime) -> None:
    WebhookEndpoint.objects.filter(pk=endpoint.pk, enabled=True).update(
        enabled=False, disabled_reason=reason, disabled_at=now, updated_at=timezone.now()
    )
    transaction.on_commit(subscriptions_forget)


def webhook_endpoint_set_enabled(
    *, endpoint_id: int, enabled: bool, reason: str = "", now: datetime | None = None
) -> int:
    """Enable or disable an endpoint (disabled: `reason`, e.g. "disabled_by_staff"). An
    enabled endpoint's pending deliveries are due again at once. Returns rows changed."""
    now = now_or(now)
    with transaction.atomic():
        if not enabled:
            changed = WebhookEndpoint.objects.filter(pk=endpoint_id, enabled=True).update(
                enabled=False, disabled_reason=reason, disabled_at=now, updated_at=timezone.now()
            )
        else:
            changed = WebhookEndpoint.objects.filter(pk=endpoint_id, enabled=False).update(
                enabled=True, disabled_reason="", disabled_at=None, updated_at=timezone.now()
            )
            WebhookDelivery.objects.filter(
                Q(next_attempt_at__gt=now) | Q(next_attempt_at__isnull=True),
                endpoint_id=endpoint_id,
                state=WebhookDelivery.State.PENDING,
            ).update(next_attempt_at=now)
        transaction.on_commit(subscriptions_forget)
    return changed


__all__ = [
    "Outcome",
    "backoff",
    "event_payload",
    "webhook_deliveries_prune",
    "webhook_deliveries_send_due",
    "webhook_delivery_attempt",
    "webhook_delivery_replay",
    "webhook_endpoint_set_enabled",
    "webhook_event_publish",
    "webhook_event_record",
    "webhook_failing_alert",
    "webhook_test_send",
]
