"""Signed webhooks (docs/webhooks.md): the endpoints admins keep, the events a purchase's
changes publish, and each event's delivery to each endpoint with every attempt."""

from __future__ import annotations

import re
from typing import Any

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q
from django_fsm import ConcurrentTransitionMixin, transition

from core.fsm import FSMField
from core.refs import new_ref
from webhooks.urlguard import UrlRefused, url_check

# Every type an endpoint can subscribe to, with what it means (docs/webhooks.md).
EVENT_TYPES: dict[str, str] = {
    "purchase.paid": "The purchase's payment settled (or its prepaid debit was made).",
    "purchase.succeeded": "The paid work succeeded; the result is stored for the buyer.",
    "purchase.failed": "The payment or the paid work failed (the reason code says which).",
    "purchase.outcome_unknown": "The executor could not say what happened: rechecked later.",
    "purchase.escalated": "An escalation was opened for a person (owner and reason).",
    "purchase.resolved": "An escalation was resolved.",
    "settlement.reorged": "A reorg moved or undid the settled transfer before it was final.",
    "refund.proposed": "Support proposed a refund; not owed until finance approves it.",
    "refund.owed": "A refund is owed to the buyer.",
    "refund.paid": "A refund was paid back (or credited to the prepaid balance).",
    "refund.declined": "A proposed refund was declined.",
    "payout.sent": "A refund's payout transaction was broadcast from the refund wallet.",
    "payout.failed": "A refund's payout failed, provably: no money moved.",
    "refund_request.opened": "A buyer asked for a refund (the request is in `refund_request`).",
    "refund_request.decided": "Staff approved or denied a buyer's refund request.",
    "webhook.test": "Sent from the admin's 'Send a test event': no purchase.",
}
ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,99}")
KEY_ID = re.compile(r"[A-Za-z0-9_-]{1,32}")
EVENT_TYPE_CHOICES = [(name, name) for name in EVENT_TYPES]


def new_event_id() -> str:
    return new_ref("evt")


class WebhookEndpoint(models.Model):
    """Where the seller's other systems hear of purchases. The signing secrets are named by
    the environment variables holding them (like an upstream's), never stored.

    With `api_key` set it is that key's callback URL: it hears of its buyer's purchases only,
    set through the API (webhooks.services.webhook_callback_set); its secret is derived from
    CALLBACK_SECRET_KEY and `secret_salt` (webhooks.services.callback_secret), never stored."""

    url = models.URLField(max_length=500, help_text="HTTPS in production; http only in DEBUG.")
    description = models.CharField(max_length=200, blank=True)
    event_types = models.JSONField(
        default=list, blank=True, help_text="Types it receives; empty: every type."
    )
    secret_env = models.CharField(
        max_length=100,
        blank=True,
        help_text="NAME of the environment variable holding the current signing secret.",
    )
    key_id = models.CharField(max_length=32, help_text="Key id sent with the signature (kid).")
    previous_secret_env = models.CharField(
        max_length=100,
        blank=True,
        help_text="During a rotation: the old secret's variable; events are signed with both.",
    )
    previous_key_id = models.CharField(max_length=32, blank=True)
    enabled = models.BooleanField(default=True)
    disabled_reason = models.CharField(max_length=64, blank=True)
    disabled_at = models.DateTimeField(null=True, blank=True)
    # Since the first failed try after its last 2xx (None while it answers); a person is told
    # once it has failed for FAILING_ALERT_AFTER (webhooks.services.webhook_failing_alert).
    failing_since = models.DateTimeField(null=True, blank=True)
    failing_alerted_at = models.DateTimeField(null=True, blank=True)
    api_key = models.OneToOneField(
        "purchases.ApiKey",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="webhook_callback",
        help_text="Set: this key's callback URL, for its buyer's purchases only.",
    )
    secret_salt = models.CharField(max_length=64, blank=True, editable=False)
    # One sweep or publication at a time sends to an endpoint (its lane), until then.
    lane_until = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    def clean(self) -> None:
        """The URL guard's checks (webhooks.urlguard: https in production, no private
        address); variable NAMES, not secrets; key ids; known event types."""
        errors: dict[str, str] = {}
        try:
            url_check(self.url or "")
        except UrlRefused as refused:
            errors["url"] = refused.message
        if self.api_key_id is None and not self.secret_env:
            errors["secret_env"] = "Name the variable holding the signing secret."  # noqa: S105
        for name in ("secret_env", "previous_secret_env"):
            value = getattr(self, name)
            if value and not ENV_NAME.fullmatch(value):
                errors[name] = "An environment variable NAME (A-Z, 0-9, _), not the secret."
        if not KEY_ID.fullmatch(self.key_id or ""):
            errors["key_id"] = "A key id: letters, digits, - and _."
        if self.previous_secret_env and not KEY_ID.fullmatch(self.previous_key_id or ""):
            errors["previous_key_id"] = "Name the old secret's key id."
        if self.previous_key_id and self.previous_key_id == self.key_id:
            errors["previous_key_id"] = "The old key id must differ from the current one."
        unknown = [t for t in self.event_types or [] if t not in EVENT_TYPES]
        if not isinstance(self.event_types, list) or unknown:
            errors["event_types"] = f"A list of event types from: {', '.join(EVENT_TYPES)}."
        if errors:
            raise ValidationError(errors)

    def subscribes_to(self, event_type: str) -> bool:
        return not self.event_types or event_type in self.event_types

    def __str__(self) -> str:
        return self.description or self.url


class WebhookEvent(models.Model):
    """One event, written in the transaction of the change it reports. Its body (the
    document the API serves for the purchase) is frozen when it is published, so every
    delivery and retry sends the same bytes."""

    public_id = models.CharField(max_length=40, unique=True, default=new_event_id, editable=False)
    type = models.CharField(max_length=40, choices=EVENT_TYPE_CHOICES)
    purchase = models.ForeignKey(
        "purchases.Purchase",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="webhook_events",
    )
    # 1, 2, 3 ... per purchase in the order its changes committed (taken under its row lock).
    sequence = models.PositiveIntegerField(default=0)
    reason_code = models.CharField(max_length=64, blank=True)
    occurred_at = models.DateTimeField()
    body = models.JSONField(null=True, blank=True)
    published_at = models.DateTimeField(null=True, blank=True)
    # A test event goes to this endpoint only.
    only_endpoint = models.ForeignKey(
        WebhookEndpoint, on_delete=models.CASCADE, null=True, blank=True, related_name="+"
    )

    class Meta:
        constraints = [
            # Most changes are recorded under the purchase's row lock, not all (an escalation
            # is resolved under its own): two racing events cannot take one number.
            models.UniqueConstraint(
                fields=["purchase", "sequence"],
                condition=Q(purchase__isnull=False),
                name="one_webhook_sequence_per_purchase",
            ),
        ]
        indexes = [
            # The sweep's look-up of events whose publication was lost.
            models.Index(
                fields=["occurred_at"],
                condition=Q(published_at__isnull=True),
                name="webhook_event_unpublished",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.public_id} {self.type}"


class WebhookDelivery(ConcurrentTransitionMixin, models.Model):
    """One event to one endpoint, at least once: retried with backoff until a 2xx, a 410
    (the endpoint is disabled) or the retry window's end."""

    class State(models.TextChoices):
        PENDING = "pending"
        DELIVERED = "delivered"
        FAILED = "failed"

    endpoint = models.ForeignKey(
        WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries"
    )
    event = models.ForeignKey(WebhookEvent, on_delete=models.CASCADE, related_name="deliveries")
    state = FSMField(default=State.PENDING, choices=State.choices, protected=True)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status = models.PositiveSmallIntegerField(null=True, blank=True)
    failure_reason = models.CharField(max_length=64, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    # The retry window runs from here (the first try, or a replay).
    window_started_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["endpoint", "event"], name="one_delivery_per_event"),
        ]
        indexes = [
            models.Index(
                fields=["next_attempt_at"],
                condition=Q(state="pending"),
                name="webhook_delivery_due",
            ),
            # The pruning sweep's look-up of delivered deliveries past retention.
            models.Index(
                fields=["delivered_at"],
                condition=Q(state="delivered"),
                name="webhook_delivery_delivered",
            ),
        ]

    @transition(field=state, source=State.PENDING, target=State.DELIVERED)
    def deliver(self, *, at: Any, status: int) -> None:
        self.delivered_at = at
        self.last_status = status
        self.next_attempt_at = None

    @transition(field=state, source=State.PENDING, target=State.FAILED)
    def fail(self, *, reason: str) -> None:
        self.failure_reason = reason
        self.next_attempt_at = None

    @transition(
        field=state,
        source=[State.PENDING, State.DELIVERED, State.FAILED],
        target=State.PENDING,
    )
    def replay(self, *, at: Any) -> None:
        self.failure_reason = ""
        self.next_attempt_at = at
        self.window_started_at = at

    def __str__(self) -> str:
        return f"{self.event} -> {self.endpoint}"


class WebhookAttempt(models.Model):
    """One POST of a delivery: what came back, how fast."""

    delivery = models.ForeignKey(
        WebhookDelivery, on_delete=models.CASCADE, related_name="attempt_rows"
    )
    attempted_at = models.DateTimeField()
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    latency_ms = models.PositiveIntegerField()
    # At most RESPONSE_EXCERPT characters of what the endpoint answered.
    response_excerpt = models.TextField(blank=True)
    error = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["-attempted_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.delivery_id} @ {self.attempted_at:%Y-%m-%d %H:%M:%S}"
