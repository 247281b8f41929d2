"""Signed webhooks in the admin (docs/webhooks.md): admins only. No role in
backoffice.roles lists these models, so support and finance neither see nor run them.

Endpoints are configuration an admin edits here (validated by the model's clean); their
state changes and every delivery go through webhooks.services.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from core.admin import ReadOnlyInline, ReadOnlyModelAdmin, RoleScopedAdmin
from webhooks.models import (
    EVENT_TYPE_CHOICES,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
)
from webhooks.services import (
    webhook_delivery_replay,
    webhook_endpoint_set_enabled,
    webhook_test_send,
)

# An endpoint's page lists this many of its latest deliveries (the deliveries list has all).
RECENT_DELIVERIES = 25


class WebhookEndpointForm(forms.ModelForm):
    url = forms.URLField(max_length=500, assume_scheme="https")  # a bare host means https
    event_types = forms.MultipleChoiceField(
        choices=EVENT_TYPE_CHOICES,
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="None ticked: every type.",
    )

    class Meta:
        model = WebhookEndpoint
        fields = (
            "url",
            "description",
            "event_types",
            "secret_env",
            "key_id",
            "previous_secret_env",
            "previous_key_id",
        )


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(RoleScopedAdmin, admin.ModelAdmin):
    form = WebhookEndpointForm
    list_display = (
        "url",
        "description",
        "enabled",
        "disabled_reason",
        "pending_count",
        "failed_count",
        "updated_at",
    )
    list_filter = ("enabled",)
    search_fields = ("url", "description")
    readonly_fields = ("enabled", "disabled_reason", "disabled_at", "recent_deliveries")
    actions = ("send_test_event", "disable_endpoints", "enable_endpoints")

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[Any]:
        editable = list(WebhookEndpointForm.Meta.fields)
        return editable if obj is None else [*editable, *self.readonly_fields]

    def get_queryset(self, request: HttpRequest) -> QuerySet[WebhookEndpoint]:
        return (
            super()
            .get_queryset(request)
            .annotate(
                pending=Count("deliveries", filter=Q(deliveries__state="pending")),
                failed=Count("deliveries", filter=Q(deliveries__state="failed")),
            )
        )

    @admin.display(description="pending", ordering="pending")
    def pending_count(self, obj: Any) -> int:
        return int(getattr(obj, "pending", 0))

    @admin.display(description="failed", ordering="failed")
    def failed_count(self, obj: Any) -> int:
        return int(getattr(obj, "failed", 0))

    @admin.display(description="latest deliveries")
    def recent_deliveries(self, obj: WebhookEndpoint) -> str:
        rows = obj.deliveries.select_related("event").order_by("-created_at", "-pk")[
            :RECENT_DELIVERIES
        ]
        body = format_html_join(
            "",
            "<tr><td><a href='{}'>{}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
            "<td>{}</td></tr>",
            (
                (
                    reverse("admin:webhooks_webhookdelivery_change", args=[d.pk]),
                    d.event.public_id,
                    d.event.type,
                    d.state,
                    d.attempts,
                    d.last_status or "-",
                    d.next_attempt_at or "-",
                )
                for d in rows
            ),
        )
        return (
            format_html(
                "<table><tr><th>event</th><th>type</th><th>state</th><th>tries</th>"
                "<th>last status</th><th>next try</th></tr>{}</table>",
                body,
            )
            if rows
            else "none yet"
        )

    @admin.action(description="Send a test event")
    def send_test_event(self, request: HttpRequest, queryset: QuerySet[WebhookEndpoint]) -> None:
        for endpoint in queryset:
            event = webhook_test_send(endpoint_id=endpoint.pk)
            self.message_user(
                request, f"Test event {event.public_id} queued for {endpoint.url}", messages.SUCCESS
            )

    @admin.action(description="Disable")
    def disable_endpoints(self, request: HttpRequest, queryset: QuerySet[WebhookEndpoint]) -> None:
        changed = sum(
            webhook_endpoint_set_enabled(endpoint_id=pk, enabled=False, reason="disabled_by_staff")
            for pk in queryset.values_list("pk", flat=True)
        )
        self.message_user(request, f"{changed} endpoint(s) disabled", messages.SUCCESS)

    @admin.action(description="Enable (pending deliveries are sent again)")
    def enable_endpoints(self, request: HttpRequest, queryset: QuerySet[WebhookEndpoint]) -> None:
        changed = sum(
            webhook_endpoint_set_enabled(endpoint_id=pk, enabled=True)
            for pk in queryset.values_list("pk", flat=True)
        )
        self.message_user(request, f"{changed} endpoint(s) enabled", messages.SUCCESS)


class WebhookAttemptInline(ReadOnlyInline):
    model = WebhookAttempt
    fields = ("attempted_at", "status_code", "latency_ms", "error", "response_excerpt")
    show_change_link = False


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(ReadOnlyModelAdmin):
    list_display = (
        "pk",
        "event",
        "event_type",
        "endpoint",
        "state",
        "attempts",
        "last_status",
        "next_attempt_at",
        "created_at",
    )
    list_filter = ("state", "endpoint")
    list_select_related = ("event", "endpoint")
    search_fields = ("=event__public_id", "=event__purchase__ref")
    fields = (
        "event",
        "endpoint",
        "state",
        "attempts",
        "last_status",
        "failure_reason",
        "next_attempt_at",
        "window_started_at",
        "delivered_at",
        "created_at",
    )
    inlines = (WebhookAttemptInline,)
    actions = ("replay_deliveries",)

    @admin.display(description="type")
    def event_type(self, obj: WebhookDelivery) -> str:
        return obj.event.type

    @admin.action(description="Replay (send again now)")
    def replay_deliveries(self, request: HttpRequest, queryset: QuerySet[WebhookDelivery]) -> None:
        for pk in queryset.values_list("pk", flat=True):
            webhook_delivery_replay(delivery_id=pk)
        self.message_user(
            request, f"{queryset.count()} delivery(ies) queued again", messages.SUCCESS
        )


@admin.register(WebhookEvent)
class WebhookEventAdmin(ReadOnlyModelAdmin):
    list_display = ("public_id", "type", "purchase", "sequence", "occurred_at", "published_at")
    list_filter = ("type",)
    list_select_related = ("purchase",)
    search_fields = ("=public_id", "=purchase__ref")
    fields = (
        "public_id",
        "type",
        "purchase",
        "sequence",
        "reason_code",
        "occurred_at",
        "published_at",
        "body",
    )
