"""The x402 paid URLs: one per offering, at /x402/<offering>. Thin: parse, one call, render."""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from purchases.api.serializers import ProblemSerializer
from purchases.api.throttles import PAID_THROTTLES
from purchases.models import Buyer
from purchases.services.x402_checkout import x402_offer, x402_pay
from purchases.services.x402_settlement import X402Answer

PAYMENT_SIGNATURE = OpenApiParameter(
    "PAYMENT-SIGNATURE",
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    required=False,
    description="base64 JSON x402 v2 PaymentPayload with extensions['payment-identifier'].info.id.",
)


def _render(answer: X402Answer) -> Response | HttpResponse:
    headers = dict(answer.headers)
    content_type = headers.pop("Content-Type", None)
    if isinstance(answer.body, bytes | bytearray | memoryview):
        response = HttpResponse(
            bytes(answer.body),
            status=answer.status,
            content_type=answer.content_type or "application/octet-stream",
        )
        for name, value in headers.items():
            response[name] = value
        return response
    # Browsers and SDKs both read the requirement from the header; expose it to CORS readers too.
    headers["Access-Control-Expose-Headers"] = "PAYMENT-REQUIRED, PAYMENT-RESPONSE, Retry-After"
    return Response(answer.body, status=answer.status, headers=headers, content_type=content_type)


class X402PaidApi(APIView):
    """Buy one offering over x402. The request body is the offering's input (JSON)."""

    permission_classes = [AllowAny]  # an API key is optional: it makes quotes deterministic
    throttle_classes = PAID_THROTTLES

    @extend_schema(
        request=OpenApiTypes.OBJECT,
        parameters=[PAYMENT_SIGNATURE],
        responses={
            (200, "*/*"): OpenApiTypes.BINARY,
            202: OpenApiTypes.OBJECT,
            400: ProblemSerializer,
            402: ProblemSerializer,
            409: ProblemSerializer,
            503: ProblemSerializer,
        },
        summary="x402 paid endpoint: 402 with PAYMENT-REQUIRED, then pay with PAYMENT-SIGNATURE",
    )
    def post(self, request: Request, offering: str) -> Response | HttpResponse:
        buyer = request.user if isinstance(request.user, Buyer) else None
        header = request.headers.get("PAYMENT-SIGNATURE")
        resource_url = request.build_absolute_uri(request.path)
        if not header:
            raw_input: Any = request.data
            return _render(
                x402_offer(
                    offering_slug=offering,
                    raw_input=raw_input,
                    buyer=buyer,
                    resource_url=resource_url,
                )
            )
        return _render(
            x402_pay(
                offering_slug=offering,
                payment_header=header,
                buyer=buyer,
                resource_url=resource_url,
            )
        )
