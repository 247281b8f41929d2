"""Request shapes only: parsing, never rules."""

from rest_framework import serializers


class QuoteCreateInputSerializer(serializers.Serializer):
    offering = serializers.SlugField(max_length=64)
    input = serializers.JSONField()


class PurchaseCreateInputSerializer(serializers.Serializer):
    rail = serializers.CharField(max_length=16)


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
