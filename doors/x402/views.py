"""The x402 paid URLs (/x402/<offering>), the capability status URLs and discovery.

Thin: parse, one call, render.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import APISettings
from rest_framework.views import APIView

from doors.rest.answers import COPY_HEADER
from doors.rest.serializers import ProblemSerializer
from doors.rest.throttles import PAID_THROTTLES
from doors.x402.answers import (
    X402Answer,
    X402Answers,
    x402_capability_answer,
    x402_offer_answer,
    x402_sign_in_answer,
)
from doors.x402.waiting import Waiting, returns_wait
from fulfillment.executors.passthrough import PassedRequest
from fulfillment.refund_receipt_signing import published_receipts_document
from payments.rails.x402.sign_in import SIGN_IN_HEADER
from purchases.models import Buyer, Offering
from purchases.services.checkout.flow import PaymentPending
from purchases.services.x402.checkout import x402_pay
from purchases.services.x402.offers import (
    input_from_query,
    x402_catalog,
    x402_offer,
    x402_offer_from_query,
    x402_offer_price_only,
)
from purchases.services.x402.passthrough import x402_passed_input

PAYMENT_SIGNATURE = OpenApiParameter(
    "PAYMENT-SIGNATURE",
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    required=False,
    description="base64 JSON x402 v2 PaymentPayload. The payment-identifier id is optional: "
    "without one the payment is keyed by (network, payer, nonce).",
)
SIGN_IN = OpenApiParameter(
    SIGN_IN_HEADER,
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    required=False,
    description="base64 JSON sign-in-with-x proof (CAIP-122 / EIP-4361) answering the 402's "
    "challenge: the payer of a settled purchase of this input gets it again without paying "
    "while its result is kept; otherwise the ordinary 402 with `sign_in.refused`.",
)
COPY = OpenApiParameter(
    COPY_HEADER,
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    required=False,
    description="A label for a deliberate extra copy of the same input inside the duplicate "
    "window (1-64 of [A-Za-z0-9_-]); retries with the same label are still not charged.",
)
PAID_RESPONSES: dict[Any, Any] = {
    (200, "*/*"): OpenApiTypes.BINARY,
    202: OpenApiTypes.OBJECT,
    400: ProblemSerializer,
    402: ProblemSerializer,
    409: ProblemSerializer,
    # Both methods are throttled (PAID_THROTTLES), GET as much as POST.
    429: OpenApiResponse(ProblemSerializer, "Too many requests (throttled); see Retry-After."),
    503: ProblemSerializer,
}
# Only POST validates a body for its 402: an invalid query string gets the price-only 402.
POST_RESPONSES: dict[Any, Any] = {
    **PAID_RESPONSES,
    422: OpenApiResponse(
        ProblemSerializer, "The input is invalid (invalid_input, input_too_large)."
    ),
}


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
    return Response(answer.body, status=answer.status, headers=headers, content_type=content_type)


class HandedOff(HttpResponse):
    """Not an answer: the payment's wait, for the event loop serving this request to sleep
    through and then finish the answer (doors.x402.paid_async); never sent."""

    def __init__(self, waiting: Waiting[Response | HttpResponse]) -> None:
        super().__init__(status=500)
        self.waiting = waiting


def _buyer(request: Request) -> Buyer | None:
    return request.user if isinstance(request.user, Buyer) else None


class X402PaidApi(APIView):
    """Buy one offering over x402: POST its input as JSON (or GET with query parameters)."""

    permission_classes = [AllowAny]  # an API key is optional: it makes quotes deterministic
    throttle_classes = PAID_THROTTLES

    def _sign_in(
        self, request: Request, offering: str, header: str, raw_input: Any, from_query: bool
    ) -> Response | HttpResponse:
        return _render(
            x402_sign_in_answer(
                offering_slug=offering,
                header=header,
                raw_input=raw_input,
                buyer=_buyer(request),
                resource_url=request.build_absolute_uri(request.path),
                from_query=from_query,
            )
        )

    def _pay(
        self,
        request: Request,
        offering: str,
        header: str,
        from_query: bool,
        passed: dict[str, Any] | None = None,
    ) -> Response | HttpResponse:
        def carried(sold: Offering) -> Any:
            # Read only for a quote the 402 signed instead of writing: its input comes back.
            if passed is not None:
                return passed
            if from_query:
                return input_from_query(sold, request.query_params.dict())
            return request.data

        answer = x402_pay(
            offering_slug=offering,
            payment_header=header,
            buyer=_buyer(request),
            answers=X402Answers(),
            copy_label=request.headers.get(COPY_HEADER),
            carried_input=carried,
            returns_wait=returns_wait(),
        )
        if isinstance(answer, PaymentPending):
            # Served on an event loop (doors.x402.paid_async): it sleeps through the wait
            # for the block and then finishes this response as dispatch would have.
            # dispatch's finalize_response consumes the headers: these are the handler's.
            headers = dict(self.headers)
            return HandedOff(
                Waiting(
                    answer,
                    lambda resumed: self._finish(request, headers, lambda: _render(resumed())),
                )
            )
        return _render(answer)

    def _finish(
        self,
        request: Request,
        headers: dict[str, str],
        rest: Callable[[], Response | HttpResponse],
    ) -> Response | HttpResponse:
        """What APIView.dispatch does with a handler's answer or exception."""
        self.headers = headers
        try:
            response = rest()
        except Exception as exc:
            response = self.handle_exception(exc)
        return self.finalize_response(request, response)  # type: ignore[arg-type]  # any HttpResponse

    @extend_schema(
        request=OpenApiTypes.OBJECT,
        parameters=[PAYMENT_SIGNATURE, SIGN_IN, COPY],
        responses=POST_RESPONSES,
        summary="x402 paid endpoint: 402 with PAYMENT-REQUIRED, then pay with PAYMENT-SIGNATURE",
    )
    def post(self, request: Request, offering: str) -> Response | HttpResponse:
        header = request.headers.get("PAYMENT-SIGNATURE")
        if header:
            return self._pay(request, offering, header, from_query=False)
        sign_in = request.headers.get(SIGN_IN_HEADER)
        if sign_in:
            return self._sign_in(request, offering, sign_in, request.data, from_query=False)
        offer = x402_offer(
            offering_slug=offering,
            raw_input=request.data,
            buyer=_buyer(request),
            resource_url=request.build_absolute_uri(request.path),
        )
        return _render(x402_offer_answer(offer))

    @extend_schema(
        parameters=[PAYMENT_SIGNATURE, SIGN_IN, COPY],
        responses=PAID_RESPONSES,
        summary="x402 paid endpoint by GET: the query string is the input (flat inputs only)",
    )
    def get(self, request: Request, offering: str) -> Response | HttpResponse:
        header = request.headers.get("PAYMENT-SIGNATURE")
        if header:
            return self._pay(request, offering, header, from_query=True)
        sign_in = request.headers.get(SIGN_IN_HEADER)
        if sign_in:
            params = request.query_params.dict()
            return self._sign_in(request, offering, sign_in, params, from_query=True)
        offer = x402_offer_from_query(
            offering_slug=offering,
            params=request.query_params.dict(),
            buyer=_buyer(request),
            resource_url=request.build_absolute_uri(request.path),
        )
        return _render(x402_offer_answer(offer))

    @extend_schema(exclude=True)
    def head(self, request: Request, offering: str) -> Response | HttpResponse:
        # Never settles and writes nothing: the price-only 402, whatever headers came.
        offer = x402_offer_price_only(
            offering_slug=offering, resource_url=request.build_absolute_uri(request.path)
        )
        return _render(x402_offer_answer(offer))


def _raw_path(request: Request) -> str | None:
    """The request target as sent, before the server decoded it: gunicorn's RAW_URI, or the
    ASGI scope's raw_path (uvicorn). None where the server keeps only the decoded path."""
    raw = request.META.get("RAW_URI") or request.META.get("REQUEST_URI")
    if raw is None:
        scope = getattr(request._request, "scope", None) or {}
        target = scope.get("raw_path")
        raw = target.decode("latin-1") if isinstance(target, bytes) else None
    return None if raw is None else str(raw).partition("?")[0]


class _QueryPassedThrough(DefaultContentNegotiation):
    """The query string is the upstream's: DRF's `?format=` override would answer 404 to a
    paid call of `/export?format=csv`."""

    settings = APISettings(user_settings={"URL_FORMAT_OVERRIDE": None})  # type: ignore[assignment,arg-type]  # only this one is read


class X402PassThroughApi(X402PaidApi):
    """Buy one call of an existing API: `/x402/<offering>/<rest>` is the upstream's `<rest>`,
    its method, query string and body passed through (docs/upstreams.md). The request is the
    input: a retry of the same request is the same purchase."""

    content_negotiation_class = _QueryPassedThrough

    def _through(self, request: Request, offering: str, rest: str) -> Response | HttpResponse:
        passed = PassedRequest(
            method=str(request.method),
            path="/" + rest,
            query=request.META.get("QUERY_STRING", ""),
            content_type=request.META.get("CONTENT_TYPE", ""),
            body=request.body,  # bounded by DATA_UPLOAD_MAX_MEMORY_SIZE (request_too_large)
        )
        raw_input = x402_passed_input(
            offering_slug=offering, request=passed, raw_path=_raw_path(request)
        )
        header = request.headers.get("PAYMENT-SIGNATURE")
        if header:
            return self._pay(request, offering, header, from_query=False, passed=raw_input)
        sign_in = request.headers.get(SIGN_IN_HEADER)
        if sign_in:
            return self._sign_in(request, offering, sign_in, raw_input, from_query=False)
        offer = x402_offer(
            offering_slug=offering,
            raw_input=raw_input,
            buyer=_buyer(request),
            resource_url=request.build_absolute_uri(request.path),
        )
        return _render(x402_offer_answer(offer))

    @extend_schema(
        request=OpenApiTypes.BINARY,
        parameters=[PAYMENT_SIGNATURE, SIGN_IN, COPY],
        responses=POST_RESPONSES,
        summary="x402 paid call of an existing API, passed through to the offering's upstream",
    )
    def post(self, request: Request, offering: str, rest: str = "") -> Response | HttpResponse:  # type: ignore[override]
        return self._through(request, offering, rest)

    @extend_schema(parameters=[PAYMENT_SIGNATURE, SIGN_IN, COPY], responses=POST_RESPONSES)
    def get(self, request: Request, offering: str, rest: str = "") -> Response | HttpResponse:  # type: ignore[override]
        return self._through(request, offering, rest)

    @extend_schema(parameters=[PAYMENT_SIGNATURE, SIGN_IN, COPY], responses=POST_RESPONSES)
    def put(self, request: Request, offering: str, rest: str = "") -> Response | HttpResponse:
        return self._through(request, offering, rest)

    @extend_schema(parameters=[PAYMENT_SIGNATURE, SIGN_IN, COPY], responses=POST_RESPONSES)
    def patch(self, request: Request, offering: str, rest: str = "") -> Response | HttpResponse:
        return self._through(request, offering, rest)

    @extend_schema(parameters=[PAYMENT_SIGNATURE, SIGN_IN, COPY], responses=POST_RESPONSES)
    def delete(self, request: Request, offering: str, rest: str = "") -> Response | HttpResponse:
        return self._through(request, offering, rest)

    @extend_schema(exclude=True)
    def head(self, request: Request, offering: str, rest: str = "") -> Response | HttpResponse:  # type: ignore[override]
        return super().head(request, offering)


class X402PurchaseCapabilityApi(APIView):
    """One purchase's status and, once ready, its result: the URL is the credential."""

    authentication_classes: list[type] = []
    permission_classes = [AllowAny]

    @extend_schema(
        responses={
            (200, "*/*"): OpenApiTypes.BINARY,
            202: OpenApiTypes.OBJECT,
            402: ProblemSerializer,
            404: ProblemSerializer,
            409: ProblemSerializer,
            410: ProblemSerializer,
        },
        auth=[],
        summary="Poll a purchase by its capability URL (from a 202's Location); no API key",
    )
    def get(self, request: Request, ref: str, token: str) -> Response | HttpResponse:
        return _render(x402_capability_answer(ref=ref, token=token))


class X402DiscoveryApi(APIView):
    """What can be bought over x402 here: every paid URL with its requirements and input."""

    authentication_classes: list[type] = []
    permission_classes = [AllowAny]

    @extend_schema(responses={200: OpenApiTypes.OBJECT}, auth=[], summary="x402 discovery")
    def get(self, request: Request) -> Response:
        base_url = request.build_absolute_uri("/").rstrip("/")
        return Response(x402_catalog(base_url=base_url))


class ReceiptKeysApi(APIView):
    """The receipt keys (docs/receipts.md): the EIP-712 domain and types receipts are signed
    under, and every key that signed one, current and retired."""

    authentication_classes: list[type] = []
    permission_classes = [AllowAny]

    @extend_schema(responses={200: OpenApiTypes.OBJECT}, auth=[], summary="Receipt signing keys")
    def get(self, request: Request) -> Response:
        return Response(published_receipts_document())
