"""Request shapes only: parsing, never rules."""

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from webhooks.models import EVENT_TYPES


@extend_schema_field({"type": "object", "description": "Input matching the offering's schema."})
class InputField(serializers.JSONField):
    """Any JSON here; the offering's schema decides (a non-object is 422 invalid_input)."""


@extend_schema_field({"type": "string", "enum": ["prepaid"]})
class RailField(serializers.CharField):
    """Documented as the one rail this endpoint takes; others are 400 unsupported_rail."""


class QuoteCreateInputSerializer(serializers.Serializer):
    offering = serializers.SlugField(max_length=64)
    input = InputField()


class PurchaseCreateInputSerializer(serializers.Serializer):
    rail = RailField(max_length=16)


class WebhookCallbackInputSerializer(serializers.Serializer):
    # Longer than the guard takes, so the guard names the reason (url_malformed).
    url = serializers.CharField(min_length=1, max_length=2_000, help_text="https:// in production.")
    event_types = serializers.ListField(
        child=serializers.ChoiceField(choices=sorted(EVENT_TYPES)),
        required=False,
        max_length=64,
        help_text="Types to receive (docs/webhooks.md); left out or empty: every type.",
    )


class RefundRequestInputSerializer(serializers.Serializer):
    # Atomic units as a decimal string, as x402's `amount`: money is never a float.
    amount = serializers.RegexField(r"^[1-9][0-9]{0,29}$", max_length=30)
    reason = serializers.CharField(
        max_length=1000, allow_blank=True, default="", trim_whitespace=False
    )


class ProblemSerializer(serializers.Serializer):
    """RFC 9457 problem details, as every error is answered (for the OpenAPI schema)."""

    type = serializers.CharField()
    title = serializers.CharField()
    status = serializers.IntegerField()
    detail = serializers.CharField()
    code = serializers.CharField(help_text="Stable error code; see docs/errors.md.")
    purchase = serializers.CharField(allow_null=True)
    next_action = serializers.CharField()
    owner = serializers.CharField()
    retryable = serializers.BooleanField()
