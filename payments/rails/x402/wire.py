"""The x402 v2 wire format, through the `x402` package's types and header codecs.

This is the small Django-side adapter: build PAYMENT-REQUIRED, decode PAYMENT-SIGNATURE
defensively (a malformed header is the client's problem, never our 5xx), and encode
PAYMENT-RESPONSE.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from x402.extensions.payment_identifier import (
    PAYMENT_IDENTIFIER,
    declare_payment_identifier_extension,
)
from x402.http.constants import (
    PAYMENT_REQUIRED_HEADER,
    PAYMENT_RESPONSE_HEADER,
    PAYMENT_SIGNATURE_HEADER,
)
from x402.http.utils import (
    encode_payment_required_header,
    encode_payment_response_header,
)
from x402.schemas import (
    PaymentPayload,
    PaymentRequired,
    PaymentRequirements,
    ResourceInfo,
    SettleResponse,
)

from core.input_limits import JsonTooDeep, RefusedText, json_loads_bounded
from payments.rails.x402.types import NetworkConfig, Requirements

__all__ = [
    "PAYMENT_REQUIRED_HEADER",
    "PAYMENT_RESPONSE_HEADER",
    "PAYMENT_SIGNATURE_HEADER",
    "SIGNED_QUOTE",
    "DecodedPayment",
    "MalformedPayment",
    "decode_payment",
    "payment_required_header",
    "payment_response_header",
    "requirements_wire",
]


# `accepts[].extra` key of a quote's signed terms (purchases.services.x402.quote_seal).
SIGNED_QUOTE = "signedQuote"
# An honest v2 payload is about 2 KB of base64; this leaves room for echoed extensions and
# bounds what one header can make us decode (docs/security.md).
MAX_PAYMENT_SIGNATURE_CHARS = 16_384


class MalformedPayment(ValueError):
    """PAYMENT-SIGNATURE could not be decoded into an x402 v2 payment payload."""


@dataclass(frozen=True)
class DecodedPayment:
    payload: dict[str, Any]  # the scheme payload: {signature, authorization}
    accepted: dict[str, Any]  # the requirements the client says it fulfils
    payment_id: object  # None when absent; anything else is validated by the caller
    quote_id: str | None
    canonical: dict[str, Any]  # the whole payload as JSON, for the request fingerprint


def requirements_wire(requirements: Requirements, network: NetworkConfig) -> PaymentRequirements:
    return PaymentRequirements(
        scheme="exact",
        network=requirements.network,
        asset=requirements.asset,
        amount=str(requirements.amount),
        pay_to=requirements.pay_to,
        max_timeout_seconds=requirements.max_timeout_seconds,
        # The quote id travels in `extra`: the payment names the quote it pays (unsigned: the
        # first presentation of an authorization wins, whatever quote it names).
        extra={
            "name": network.token_name,
            "version": network.token_version,
            **({"quote": requirements.quote_id} if requirements.quote_id else {}),
            **dict(requirements.terms),
            **_signed_quote(requirements),
        },
    )


def _signed_quote(requirements: Requirements) -> dict[str, Any]:
    return {SIGNED_QUOTE: dict(requirements.signed_quote)} if requirements.signed_quote else {}


def payment_required_header(
    *,
    requirements: Requirements,
    network: NetworkConfig,
    resource_url: str,
    description: str,
    error: str | None = None,
    extensions: dict[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """(header value, the same document as a dict for the response body). `extensions`:
    declared beside the payment identifier (the bazaar description,
    payments.rails.x402.discovery)."""
    document = PaymentRequired(
        x402_version=2,
        error=error,
        resource=ResourceInfo(
            url=resource_url, description=description, mime_type="application/json"
        ),
        accepts=[requirements_wire(requirements, network)],
        # Optional: the official clients send no id; a payment without one is keyed by its
        # authorization (network, payer, nonce), which is single-use on chain.
        extensions={
            PAYMENT_IDENTIFIER: declare_payment_identifier_extension(required=False),
            **(extensions or {}),
        },
    )
    return encode_payment_required_header(document), document.model_dump(
        mode="json", by_alias=True, exclude_none=True
    )


def decode_payment(header_value: str) -> DecodedPayment:
    """Raises MalformedPayment for anything that is not a well-formed v2 payload.

    Size and depth are bounded before the JSON is decoded (core.input_limits), so a hostile
    header costs no more than an honest one.
    """
    value = header_value.strip()
    if len(value) > MAX_PAYMENT_SIGNATURE_CHARS:
        raise MalformedPayment(
            f"PAYMENT-SIGNATURE is longer than {MAX_PAYMENT_SIGNATURE_CHARS} characters"
        )
    try:
        # Strict: characters outside the base64 alphabet are refused, never skipped (the
        # lenient default would settle a header with "!!", "," or "@@" mixed in).
        document = json_loads_bounded(base64.b64decode(value.encode("utf-8"), validate=True))
    except (JsonTooDeep, RefusedText) as exc:
        raise MalformedPayment(f"PAYMENT-SIGNATURE: {exc}") from exc
    except (binascii.Error, ValueError) as exc:  # UnicodeError, JSONDecodeError are ValueErrors
        raise MalformedPayment(
            f"PAYMENT-SIGNATURE is not base64 JSON of an x402 payload: {type(exc).__name__}"
        ) from exc
    if not isinstance(document, dict) or document.get("x402Version", 2) != 2:
        raise MalformedPayment("only x402Version 2 payloads are accepted")
    try:
        decoded = PaymentPayload.model_validate(document)
    except ValidationError as exc:
        raise MalformedPayment(
            f"PAYMENT-SIGNATURE is not base64 JSON of an x402 payload: {type(exc).__name__}"
        ) from exc
    extension = (decoded.extensions or {}).get(PAYMENT_IDENTIFIER) or {}
    info = extension.get("info") if isinstance(extension, dict) else None
    payment_id = info.get("id") if isinstance(info, dict) else None
    accepted = decoded.accepted.model_dump(mode="json", by_alias=True, exclude_none=True)
    quote_id = (decoded.accepted.extra or {}).get("quote")
    return DecodedPayment(
        payload=decoded.payload,
        accepted=accepted,
        payment_id=payment_id,
        quote_id=quote_id if isinstance(quote_id, str) else None,
        canonical=decoded.model_dump(mode="json", by_alias=True, exclude_none=True),
    )


def payment_response_header(
    *,
    success: bool,
    transaction: str | None,
    network: str,
    payer: str,
    error_reason: str | None = None,
    amount: int | None = None,
) -> str:
    return encode_payment_response_header(
        SettleResponse(
            success=success,
            error_reason=error_reason,
            payer=payer,
            transaction=transaction or "",
            network=network,
            amount=str(amount) if amount is not None else None,
        )
    )
