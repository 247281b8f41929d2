"""Agent API views: parse, make one domain call, render."""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.clock import now_or
from core.errors import DomainError, ErrorCode
from doors.rest.answers import COPY_HEADER, receipt_headers, sent_bytes
from doors.rest.prepaid_answers import PrepaidAnswers
from doors.rest.serializers import (
    ProblemSerializer,
    PurchaseCreateInputSerializer,
    QuoteCreateInputSerializer,
    RefundRequestInputSerializer,
    WebhookCallbackInputSerializer,
)
from doors.rest.throttles import PAID_THROTTLES, RefundRequestThrottle
from payments.services import ledger_balance
from purchases.models import Buyer, RefundRequest
from purchases.refund_request_selectors import refund_request_document, refund_request_get
from purchases.selectors import (
    offerings_for_sale,
    purchase_get_for_buyer,
    purchase_status,
    quote_representation,
)
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from purchases.services.fulfil.delivery import (
    DeliveryPending,
    purchase_result_deliver,
    receipt_public,
)
from purchases.services.quote.quotes import quote_create
from purchases.services.quote.top_ups import offering_input_schema
from purchases.services.remedy.refund_requests import (
    RefundRequestOpened,
    refund_request_open,
    refund_request_open_signed,
)
from webhooks.callbacks import webhook_callback_clear, webhook_callback_get, webhook_callback_set

PROBLEM = ProblemSerializer
IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    {"type": "string", "pattern": "^[A-Za-z0-9_-]{16,128}$"},
    OpenApiParameter.HEADER,
    required=True,
    description="Your payment id: 16-128 characters of [A-Za-z0-9_-]. Store it before sending.",
)


def _buyer(request: Request) -> Buyer:
    assert isinstance(request.user, Buyer)
    return request.user


class OfferingListApi(APIView):
    @extend_schema(responses={200: OpenApiTypes.OBJECT}, summary="What can be bought")
    def get(self, request: Request) -> Response:
        offerings = offerings_for_sale()
        return Response(
            {
                "offerings": [
                    {
                        "offering": o.slug,
                        "title": o.title,
                        "description": o.description,
                        "price": str(o.price),
                        "asset": o.asset,
                        "asset_symbol": o.asset_symbol,
                        "decimals": o.asset_decimals,
                        "network": o.network,
                        "input_schema": offering_input_schema(o),
                        "stock": o.stock,
                    }
                    for o in offerings
                ]
            }
        )


class BalanceDetailApi(APIView):
    @extend_schema(responses={200: OpenApiTypes.OBJECT}, summary="Prepaid balance per asset")
    def get(self, request: Request) -> Response:
        buyer = _buyer(request)
        assets = sorted(set(buyer.ledger_entries.values_list("asset", flat=True)))
        return Response(
            {
                "buyer": buyer.ref,
                "balances": [
                    {"asset": a, "amount": str(ledger_balance(buyer_id=buyer.pk, asset=a))}
                    for a in assets
                ],
            }
        )


class QuoteCreateApi(APIView):
    throttle_classes = PAID_THROTTLES

    @extend_schema(
        request=QuoteCreateInputSerializer,
        responses={
            200: OpenApiTypes.OBJECT,
            201: OpenApiTypes.OBJECT,
            404: PROBLEM,
            409: PROBLEM,
            422: PROBLEM,
        },
        summary="Get a quote (the same input while it is open returns the same quote)",
    )
    def post(self, request: Request) -> Response:
        serializer = QuoteCreateInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        outcome = quote_create(
            buyer=_buyer(request),
            offering_slug=serializer.validated_data["offering"],
            raw_input=serializer.validated_data["input"],
        )
        return Response(
            quote_representation(quote=outcome.quote), status=201 if outcome.created else 200
        )


class QuotePurchaseApi(APIView):
    throttle_classes = PAID_THROTTLES

    @extend_schema(
        request=PurchaseCreateInputSerializer,
        parameters=[IDEMPOTENCY_KEY],
        responses={
            201: OpenApiResponse(
                OpenApiTypes.OBJECT,
                description="Paid: the purchase's status (Location names it). The same request "
                "with the same Idempotency-Key answers the same bytes again, with "
                "Idempotent-Replayed: true.",
            ),
            200: OpenApiResponse(
                OpenApiTypes.OBJECT,
                description="A repeat of a purchase already paid (same buyer, offering, "
                "input and copy label inside the duplicate window): its status, "
                "`duplicate_of` and Tollbooth-Duplicate-Of name it; nothing was charged.",
            ),
            400: PROBLEM,
            402: PROBLEM,
            409: PROBLEM,
            410: PROBLEM,
        },
        summary="Pay a quote from the prepaid balance, exactly once per payment id",
    )
    def post(self, request: Request, public_id: str) -> Response | HttpResponse:
        serializer = PurchaseCreateInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        if serializer.validated_data["rail"] != "prepaid":
            raise DomainError(
                ErrorCode.UNSUPPORTED_RAIL,
                "This endpoint takes rail 'prepaid'; pay over x402 at the offering's paid URL.",
            )
        answer, is_replay = purchase_pay_prepaid(
            buyer=_buyer(request),
            quote_id=public_id,
            payment_id=request.headers.get("Idempotency-Key"),
            answers=PrepaidAnswers(),
            copy_label=request.headers.get(COPY_HEADER),
        )
        headers: dict[str, Any] = dict(answer.headers)
        content_type = headers.pop("Content-Type", None)
        if is_replay:
            headers["Idempotent-Replayed"] = "true"
        if answer.purchase_ref and answer.status < 300:
            headers["Location"] = f"/api/v1/purchases/{answer.purchase_ref}"
        # The stored bytes, not a re-rendering: a replay is byte for byte the first answer.
        response = HttpResponse(
            sent_bytes(answer),
            status=answer.status,
            content_type=content_type or "application/json",
        )
        for name, value in headers.items():
            response[name] = value
        return response


class PurchaseDetailApi(APIView):
    @extend_schema(
        responses={200: OpenApiTypes.OBJECT, 404: PROBLEM},
        summary="Every boundary's state, the reason and the next move",
    )
    def get(self, request: Request, ref: str) -> Response:
        purchase = purchase_get_for_buyer(buyer=_buyer(request), ref=ref)
        return Response(purchase_status(purchase=purchase, now=now_or(None)))


class PurchaseResultApi(APIView):
    @extend_schema(
        responses={
            (200, "*/*"): OpenApiTypes.BINARY,
            202: OpenApiTypes.OBJECT,
            404: PROBLEM,
            409: PROBLEM,
            410: PROBLEM,
        },
        summary="The stored result (202 with Retry-After while the work runs or is unknown)",
    )
    def get(self, request: Request, ref: str) -> Response | HttpResponse:
        purchase = purchase_get_for_buyer(buyer=_buyer(request), ref=ref, with_result=True)
        try:
            delivery = purchase_result_deliver(purchase=purchase)
        except DeliveryPending as pending:
            return Response(
                pending.status,
                status=202,
                headers={"Retry-After": str(pending.retry_after)},
            )
        response = HttpResponse(delivery.body, content_type=delivery.content_type)
        response["Repr-Digest"] = f"sha-256=:{delivery.sha256_b64}:"
        response["Link"] = f'<{delivery.receipt_url}>; rel="receipt"'
        for name, value in receipt_headers(delivery.signed_receipt).items():
            response[name] = value
        return response


class ReceiptDetailApi(APIView):
    authentication_classes: list[type] = []
    permission_classes = [AllowAny]

    @extend_schema(
        responses={200: OpenApiTypes.OBJECT, 404: PROBLEM},
        auth=[],
        summary="Public proof of a purchase",
    )
    def get(self, request: Request, public_id: str) -> Response:
        return Response(receipt_public(public_id=public_id))


class WebhookCallbackApi(APIView):
    """The calling API key's callback URL (docs/webhooks.md, "A buyer's callback URL")."""

    @extend_schema(
        responses={200: OpenApiTypes.OBJECT, 404: PROBLEM},
        summary="This key's callback URL (never its secret)",
    )
    def get(self, request: Request) -> Response:
        return Response(webhook_callback_get(api_key_prefix=str(request.auth)).as_document())

    @extend_schema(
        request=WebhookCallbackInputSerializer,
        responses={200: OpenApiTypes.OBJECT, 400: PROBLEM},
        summary="Set this key's callback URL: a new signing secret, shown once in the answer",
    )
    def put(self, request: Request) -> Response:
        given = WebhookCallbackInputSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        callback = webhook_callback_set(
            api_key_prefix=str(request.auth),
            url=given.validated_data["url"],
            event_types=given.validated_data.get("event_types"),
        )
        return Response(callback.as_document(), headers={"Cache-Control": "no-store"})

    @extend_schema(responses={204: None, 404: PROBLEM}, summary="Remove this key's callback URL")
    def delete(self, request: Request) -> Response:
        webhook_callback_clear(api_key_prefix=str(request.auth))
        return Response(status=204)


class RefundRequestCreateApi(APIView):
    """With an API key: the key's buyer asks. Without one: the body is a refund request
    signed by the paying wallet (docs/api.md, "Refund requests")."""

    permission_classes = [AllowAny]
    throttle_classes = [RefundRequestThrottle]

    @extend_schema(
        request=RefundRequestInputSerializer,
        parameters=[
            OpenApiParameter(
                "Idempotency-Key",
                {"type": "string", "pattern": "^[A-Za-z0-9_-]{16,128}$"},
                OpenApiParameter.HEADER,
                required=True,
                description="The same key and request answer the same refund request. (The "
                "wallet path, with no API key, signs its own `idempotencyKey` instead: "
                "docs/api.md, 'Refund requests'.)",
            )
        ],
        responses={
            201: OpenApiResponse(OpenApiTypes.OBJECT, description="Opened: the request."),
            200: OpenApiResponse(
                OpenApiTypes.OBJECT,
                description="The same request again (Idempotent-Replayed: true).",
            ),
            400: PROBLEM,
            403: PROBLEM,
            404: PROBLEM,
            409: PROBLEM,
            422: PROBLEM,
            429: PROBLEM,
        },
        summary="Ask for a refund of a purchase (the payer only; one open request at a time)",
    )
    def post(self, request: Request, ref: str) -> Response:
        if isinstance(request.user, Buyer):
            opened = self._with_key(request, request.user, ref)
        else:
            opened = refund_request_open_signed(ref=ref, body=request.data)
        document = refund_request_document(request=opened.request)
        headers = {"Location": document["links"]["self"]}
        if not opened.created:
            headers["Idempotent-Replayed"] = "true"
        return Response(document, status=201 if opened.created else 200, headers=headers)

    def _with_key(self, request: Request, buyer: Buyer, ref: str) -> RefundRequestOpened:
        key = request.headers.get("Idempotency-Key")
        if not key:
            raise DomainError(ErrorCode.IDEMPOTENCY_KEY_MISSING)
        serializer = RefundRequestInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        purchase = purchase_get_for_buyer(buyer=buyer, ref=ref)
        return refund_request_open(
            purchase_id=purchase.pk,
            channel=RefundRequest.Channel.API_KEY,
            requested_by=buyer.ref,
            amount=int(serializer.validated_data["amount"]),
            reason=serializer.validated_data["reason"],
            idempotency_key=key,
        )


class RefundRequestDetailApi(APIView):
    permission_classes = [AllowAny]

    @extend_schema(
        responses={200: OpenApiTypes.OBJECT, 404: PROBLEM},
        summary="A refund request's state: pending, executed or denied (with its reason code)",
    )
    def get(self, request: Request, ref: str, public_id: str) -> Response:
        buyer = request.user if isinstance(request.user, Buyer) else None
        refund_request = refund_request_get(ref=ref, public_id=public_id, buyer=buyer)
        return Response(refund_request_document(request=refund_request))
