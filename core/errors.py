"""The one error-code type. Its values are API contract: never rename one.

Every code has an HTTP status, whose move it is next, the permitted next action and
whether retrying the same request can succeed. docs/errors.md documents each code and a
test keeps the two in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from django.conf import settings


class Owner(StrEnum):
    BUYER = "buyer"
    RECONCILIATION = "reconciliation"
    SUPPORT = "support"
    FINANCE = "finance"
    SYSTEM = "system"
    NONE = "none"


class ErrorCode(StrEnum):
    # Request shape and authentication.
    INVALID_REQUEST = "invalid_request"
    NOT_AUTHENTICATED = "not_authenticated"
    PERMISSION_DENIED = "permission_denied"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    THROTTLED = "throttled"
    IDEMPOTENCY_KEY_MISSING = "idempotency_key_missing"
    IDEMPOTENCY_KEY_INVALID = "idempotency_key_invalid"
    REQUEST_TOO_LARGE = "request_too_large"
    JSON_TOO_DEEP = "json_too_deep"
    INVALID_TEXT = "invalid_text"
    NOT_ACCEPTABLE = "not_acceptable"
    # Quote boundary.
    OFFERING_NOT_FOUND = "offering_not_found"
    INVALID_INPUT = "invalid_input"
    SOLD_OUT = "sold_out"
    QUOTE_NOT_FOUND = "quote_not_found"
    QUOTE_EXPIRED = "quote_expired"
    INPUT_TOO_LARGE = "input_too_large"
    INPUT_MISMATCH = "input_mismatch"
    QUOTE_TERMS_INVALID = "quote_terms_invalid"
    # Payment boundary.
    UNSUPPORTED_RAIL = "unsupported_rail"
    INSUFFICIENT_FUNDS = "insufficient_funds"
    SPEND_CAP_EXCEEDED = "spend_cap_exceeded"
    QUOTE_ALREADY_PAID = "quote_already_paid"
    PAYMENT_IN_FLIGHT = "payment_in_flight"
    PAYMENT_IDENTIFIER_CONFLICT = "payment_identifier_conflict"
    PAYMENT_IDENTIFIER_INVALID = "payment_identifier_invalid"
    COPY_LABEL_INVALID = "copy_label_invalid"
    # x402: authorize + verify boundary.
    PAYMENT_REQUIRED = "payment_required"
    PAYMENT_SIGNATURE_MALFORMED = "payment_signature_malformed"
    INVALID_PAYLOAD = "invalid_payload"
    UNSUPPORTED_SCHEME = "unsupported_scheme"
    NETWORK_MISMATCH = "network_mismatch"
    ASSET_MISMATCH = "asset_mismatch"
    INVALID_SIGNATURE = "invalid_signature"
    RECIPIENT_MISMATCH = "recipient_mismatch"
    AMOUNT_MISMATCH = "amount_mismatch"
    AUTHORIZATION_NOT_YET_VALID = "authorization_not_yet_valid"
    AUTHORIZATION_EXPIRED = "authorization_expired"
    AUTHORIZATION_USED = "authorization_used"
    INSUFFICIENT_BALANCE = "insufficient_balance"
    AUTHORIZATION_IN_USE = "authorization_in_use"
    VERIFICATION_UNAVAILABLE = "verification_unavailable"
    FACILITATOR_CREDENTIALS_REFUSED = "facilitator_credentials_refused"
    # We cannot settle on the network now (our relayer cannot pay the gas): nothing recorded.
    SETTLEMENT_UNAVAILABLE = "settlement_unavailable"
    # x402: settle boundary.
    PAYMENT_FAILED = "payment_failed"
    PAYMENT_REVERSED = "payment_reversed"
    # Execute and deliver boundary.
    PURCHASE_NOT_FOUND = "purchase_not_found"
    PAYMENT_NOT_COMPLETE = "payment_not_complete"
    EXECUTION_FAILED = "execution_failed"
    RESULT_EXPIRED = "result_expired"
    RETENTION_EXPIRED = "retention_expired"
    RECEIPT_NOT_FOUND = "receipt_not_found"
    # Refund requests from buyers (docs/api.md, "Refund requests").
    REFUND_REQUEST_NOT_FOUND = "refund_request_not_found"
    REFUND_NOT_AVAILABLE = "refund_not_available"
    REFUND_REQUEST_OPEN = "refund_request_open"
    REFUND_AMOUNT_EXCEEDS_REFUNDABLE = "refund_amount_exceeds_refundable"
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
    REFUND_REQUEST_SIGNATURE_INVALID = "refund_request_signature_invalid"
    REFUND_REQUEST_EXPIRED = "refund_request_expired"
    # Payouts (finance, in the back office): refunds Tollbooth pays from the refund wallet.
    PAYOUT_NOT_PAYABLE = "payout_not_payable"
    PAYOUT_DESTINATION_INVALID = "payout_destination_invalid"
    PAYOUT_CAP_EXCEEDED = "payout_cap_exceeded"
    PAYOUT_SECOND_APPROVER_REQUIRED = "payout_second_approver_required"
    PAYOUT_WALLET_UNCONFIGURED = "payout_wallet_unconfigured"
    PAYOUT_CHAIN_UNAVAILABLE = "payout_chain_unavailable"
    # A buyer's webhook callback URL (per API key).
    CALLBACK_URL_INVALID = "callback_url_invalid"
    CALLBACK_NOT_SET = "callback_not_set"
    # Offerings as code (manage.py offerings): a catalog file refused as a whole.
    CATALOG_INVALID = "catalog_invalid"
    # A dependency (the database, the broker) cannot be reached right now.
    SERVICE_UNAVAILABLE = "service_unavailable"
    # Anything unanticipated.
    INTERNAL_ERROR = "internal_error"


@dataclass(frozen=True)
class CodeSpec:
    status: int
    owner: Owner
    next_action: str
    retryable: bool
    title: str


CODE_SPECS: dict[ErrorCode, CodeSpec] = {
    ErrorCode.INVALID_REQUEST: CodeSpec(
        400, Owner.BUYER, "fix_request", False, "The request is malformed."
    ),
    ErrorCode.NOT_AUTHENTICATED: CodeSpec(
        401, Owner.BUYER, "send_api_key", False, "A valid API key is required."
    ),
    ErrorCode.PERMISSION_DENIED: CodeSpec(
        403, Owner.BUYER, "none", False, "This key may not do that."
    ),
    ErrorCode.NOT_FOUND: CodeSpec(404, Owner.BUYER, "none", False, "No such resource."),
    ErrorCode.METHOD_NOT_ALLOWED: CodeSpec(
        405, Owner.BUYER, "fix_request", False, "Method not allowed."
    ),
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: CodeSpec(
        415, Owner.BUYER, "send_json", False, "Send application/json."
    ),
    ErrorCode.THROTTLED: CodeSpec(429, Owner.BUYER, "retry_later", True, "Too many requests."),
    ErrorCode.IDEMPOTENCY_KEY_MISSING: CodeSpec(
        400, Owner.BUYER, "send_idempotency_key", False, "An Idempotency-Key header is required."
    ),
    ErrorCode.IDEMPOTENCY_KEY_INVALID: CodeSpec(
        400,
        Owner.BUYER,
        "fix_idempotency_key",
        False,
        "The Idempotency-Key must be 16-128 characters of [A-Za-z0-9_-].",
    ),
    ErrorCode.REQUEST_TOO_LARGE: CodeSpec(
        413, Owner.BUYER, "fix_request", False, "The request body is larger than allowed."
    ),
    ErrorCode.JSON_TOO_DEEP: CodeSpec(
        400, Owner.BUYER, "fix_request", False, "The JSON nests deeper than allowed."
    ),
    ErrorCode.INVALID_TEXT: CodeSpec(
        400,
        Owner.BUYER,
        "fix_request",
        False,
        "Text must not contain NUL or unpaired surrogate characters.",
    ),
    ErrorCode.NOT_ACCEPTABLE: CodeSpec(
        406, Owner.BUYER, "fix_request", False, "Accept a JSON answer (application/json)."
    ),
    ErrorCode.OFFERING_NOT_FOUND: CodeSpec(
        404, Owner.BUYER, "choose_offering", False, "No such offering."
    ),
    ErrorCode.INVALID_INPUT: CodeSpec(
        422, Owner.BUYER, "fix_input", False, "The input does not match the offering's schema."
    ),
    ErrorCode.SOLD_OUT: CodeSpec(
        409, Owner.BUYER, "retry_later", True, "The offering is sold out."
    ),
    ErrorCode.QUOTE_NOT_FOUND: CodeSpec(404, Owner.BUYER, "request_quote", False, "No such quote."),
    ErrorCode.QUOTE_EXPIRED: CodeSpec(
        410, Owner.BUYER, "request_quote", False, "The quote has expired."
    ),
    ErrorCode.INPUT_TOO_LARGE: CodeSpec(
        413, Owner.BUYER, "shrink_input", False, "The input is larger than this offering takes."
    ),
    ErrorCode.INPUT_MISMATCH: CodeSpec(
        409,
        Owner.BUYER,
        "request_quote",
        False,
        "The call's input is not the input of the quote its payment names.",
    ),
    ErrorCode.QUOTE_TERMS_INVALID: CodeSpec(
        400,
        Owner.BUYER,
        "request_quote",
        False,
        "The quote's signed terms were changed or are not ours.",
    ),
    ErrorCode.UNSUPPORTED_RAIL: CodeSpec(
        400, Owner.BUYER, "fix_request", False, "This endpoint does not take that payment rail."
    ),
    ErrorCode.INSUFFICIENT_FUNDS: CodeSpec(
        402, Owner.BUYER, "top_up_balance", False, "The prepaid balance does not cover the price."
    ),
    ErrorCode.SPEND_CAP_EXCEEDED: CodeSpec(
        402,
        Owner.BUYER,
        "raise_spend_cap_or_wait",
        False,
        "The purchase would exceed the spend cap.",
    ),
    ErrorCode.QUOTE_ALREADY_PAID: CodeSpec(
        402, Owner.BUYER, "poll_existing_purchase", False, "The quote already has a payment."
    ),
    ErrorCode.PAYMENT_IN_FLIGHT: CodeSpec(
        409,
        Owner.BUYER,
        "retry_same_key_later",
        True,
        "This payment, or the purchase it repeats, is still being processed.",
    ),
    ErrorCode.PAYMENT_IDENTIFIER_CONFLICT: CodeSpec(
        409,
        Owner.BUYER,
        "use_new_payment_id",
        False,
        "This payment id was used for a different request.",
    ),
    ErrorCode.PAYMENT_IDENTIFIER_INVALID: CodeSpec(
        400,
        Owner.BUYER,
        "fix_payment_identifier",
        False,
        "The payment identifier (extensions['payment-identifier'].info.id) must be 16-128 "
        "characters of [A-Za-z0-9_-], or left out.",
    ),
    ErrorCode.COPY_LABEL_INVALID: CodeSpec(
        400,
        Owner.BUYER,
        "fix_copy_label",
        False,
        "Tollbooth-Copy must be 1-64 characters of [A-Za-z0-9_-].",
    ),
    ErrorCode.PAYMENT_REQUIRED: CodeSpec(
        402, Owner.BUYER, "sign_and_pay", False, "Payment required: see PAYMENT-REQUIRED."
    ),
    ErrorCode.PAYMENT_SIGNATURE_MALFORMED: CodeSpec(
        400,
        Owner.BUYER,
        "fix_payment_signature",
        False,
        "PAYMENT-SIGNATURE is not a base64 x402 v2 payment payload.",
    ),
    ErrorCode.INVALID_PAYLOAD: CodeSpec(
        402,
        Owner.BUYER,
        "sign_new_authorization",
        False,
        "The authorization in the payload is malformed.",
    ),
    ErrorCode.UNSUPPORTED_SCHEME: CodeSpec(
        402, Owner.BUYER, "sign_new_authorization", False, "Only the 'exact' scheme is accepted."
    ),
    ErrorCode.NETWORK_MISMATCH: CodeSpec(
        402, Owner.BUYER, "sign_new_authorization", False, "The payment is for another network."
    ),
    ErrorCode.ASSET_MISMATCH: CodeSpec(
        402, Owner.BUYER, "sign_new_authorization", False, "The payment is in another asset."
    ),
    ErrorCode.INVALID_SIGNATURE: CodeSpec(
        402,
        Owner.BUYER,
        "sign_new_authorization",
        False,
        "The EIP-712 signature is not the payer's under the token's domain.",
    ),
    ErrorCode.RECIPIENT_MISMATCH: CodeSpec(
        402, Owner.BUYER, "sign_new_authorization", False, "The authorization pays someone else."
    ),
    ErrorCode.AMOUNT_MISMATCH: CodeSpec(
        402,
        Owner.BUYER,
        "sign_new_authorization",
        False,
        "The authorized value is not the quoted price.",
    ),
    ErrorCode.AUTHORIZATION_NOT_YET_VALID: CodeSpec(
        402, Owner.BUYER, "sign_new_authorization", False, "validAfter is in the future."
    ),
    ErrorCode.AUTHORIZATION_EXPIRED: CodeSpec(
        402,
        Owner.BUYER,
        "sign_new_authorization",
        False,
        "validBefore is past, or too close to cover settlement.",
    ),
    ErrorCode.AUTHORIZATION_USED: CodeSpec(
        402,
        Owner.BUYER,
        "look_up_purchase",
        False,
        "This authorization's nonce is already used on chain.",
    ),
    ErrorCode.INSUFFICIENT_BALANCE: CodeSpec(
        402, Owner.BUYER, "fund_wallet", False, "The payer's token balance is below the price."
    ),
    ErrorCode.AUTHORIZATION_IN_USE: CodeSpec(
        409,
        Owner.BUYER,
        "poll_existing_purchase",
        False,
        "This authorization already pays another purchase; `purchase` names it.",
    ),
    ErrorCode.VERIFICATION_UNAVAILABLE: CodeSpec(
        503,
        Owner.RECONCILIATION,
        "retry_same_payment_id_later",
        True,
        "The chain could not be read to verify the payment; nothing was recorded.",
    ),
    ErrorCode.FACILITATOR_CREDENTIALS_REFUSED: CodeSpec(
        503,
        Owner.SYSTEM,
        "retry_same_payment_id_later",
        True,
        "The facilitator that settles this network refused the seller's credentials; "
        "nothing was recorded.",
    ),
    ErrorCode.SETTLEMENT_UNAVAILABLE: CodeSpec(
        503,
        Owner.SYSTEM,
        "retry_same_payment_id_later",
        True,
        "The seller cannot settle payments on this network right now; nothing was recorded.",
    ),
    ErrorCode.PAYMENT_FAILED: CodeSpec(
        402,
        Owner.BUYER,
        "sign_new_authorization",
        False,
        "Settlement provably failed; no money moved. `reason` says why.",
    ),
    ErrorCode.PAYMENT_REVERSED: CodeSpec(
        402,
        Owner.SUPPORT,
        "contact_seller",
        False,
        "The result was delivered, but a chain reorg undid its payment and the signed "
        "authorization can no longer settle: the payment is reversed; support is escalated.",
    ),
    ErrorCode.PURCHASE_NOT_FOUND: CodeSpec(404, Owner.BUYER, "none", False, "No such purchase."),
    ErrorCode.PAYMENT_NOT_COMPLETE: CodeSpec(
        409,
        Owner.RECONCILIATION,
        "poll_purchase",
        True,
        "The payment has not completed; the result is held until it does.",
    ),
    ErrorCode.EXECUTION_FAILED: CodeSpec(
        409,
        Owner.SUPPORT,
        "see_remedy",
        False,
        "The paid work failed; a refund or escalation is linked.",
    ),
    ErrorCode.RESULT_EXPIRED: CodeSpec(
        410,
        Owner.NONE,
        "use_receipt",
        False,
        "The result is past its retention period; the receipt remains.",
    ),
    ErrorCode.RETENTION_EXPIRED: CodeSpec(
        410,
        Owner.NONE,
        "use_receipt",
        False,
        "This payment id's record is past retention; the purchase it paid is in the receipt.",
    ),
    ErrorCode.RECEIPT_NOT_FOUND: CodeSpec(404, Owner.BUYER, "none", False, "No such receipt."),
    ErrorCode.REFUND_REQUEST_NOT_FOUND: CodeSpec(
        404, Owner.BUYER, "none", False, "No such refund request."
    ),
    ErrorCode.REFUND_NOT_AVAILABLE: CodeSpec(
        409,
        Owner.BUYER,
        "poll_purchase",
        False,
        "This purchase has no settled payment to return (yet).",
    ),
    ErrorCode.REFUND_REQUEST_OPEN: CodeSpec(
        409,
        Owner.SUPPORT,
        "poll_refund_request",
        False,
        "A refund request for this purchase is already open; poll it.",
    ),
    ErrorCode.REFUND_AMOUNT_EXCEEDS_REFUNDABLE: CodeSpec(
        422,
        Owner.BUYER,
        "fix_amount",
        False,
        "The amount is above what was charged less what was already refunded.",
    ),
    ErrorCode.IDEMPOTENCY_KEY_REUSED: CodeSpec(
        422,
        Owner.BUYER,
        "use_new_idempotency_key",
        False,
        "This Idempotency-Key was used for a different request.",
    ),
    ErrorCode.REFUND_REQUEST_SIGNATURE_INVALID: CodeSpec(
        403,
        Owner.BUYER,
        "sign_with_paying_wallet",
        False,
        "The refund request is not signed by the wallet that paid for this purchase.",
    ),
    ErrorCode.REFUND_REQUEST_EXPIRED: CodeSpec(
        400,
        Owner.BUYER,
        "sign_new_refund_request",
        False,
        "The signed refund request's expiry has passed, or is too far ahead.",
    ),
    ErrorCode.PAYOUT_NOT_PAYABLE: CodeSpec(
        409,
        Owner.FINANCE,
        "see_refund",
        False,
        "The refund cannot be paid out: not an owed chain refund, its payback already named, "
        "or a payout of it is live.",
    ),
    ErrorCode.PAYOUT_DESTINATION_INVALID: CodeSpec(
        400, Owner.FINANCE, "fix_destination", False, "The destination is not an address."
    ),
    ErrorCode.PAYOUT_CAP_EXCEEDED: CodeSpec(
        409,
        Owner.FINANCE,
        "wait_for_next_day_or_raise_cap",
        False,
        "The payout would take the day's payouts in this asset past the daily cap.",
    ),
    ErrorCode.PAYOUT_SECOND_APPROVER_REQUIRED: CodeSpec(
        403,
        Owner.FINANCE,
        "ask_another_approver",
        False,
        "A destination other than the payer's needs a second approver, another staff user.",
    ),
    ErrorCode.PAYOUT_WALLET_UNCONFIGURED: CodeSpec(
        503,
        Owner.FINANCE,
        "configure_refund_wallet",
        False,
        "No refund wallet (signer, token) is configured for the refund's network.",
    ),
    ErrorCode.PAYOUT_CHAIN_UNAVAILABLE: CodeSpec(
        503,
        Owner.FINANCE,
        "retry_later",
        True,
        "The chain could not be read to sign the payout; nothing was recorded.",
    ),
    ErrorCode.CALLBACK_URL_INVALID: CodeSpec(
        400,
        Owner.BUYER,
        "fix_callback_url",
        False,
        "The callback URL is refused: malformed, not https, or not a public address.",
    ),
    ErrorCode.CALLBACK_NOT_SET: CodeSpec(
        404, Owner.BUYER, "set_callback_url", False, "This API key has no callback URL."
    ),
    ErrorCode.CATALOG_INVALID: CodeSpec(
        422,
        Owner.SUPPORT,
        "fix_catalog_file",
        False,
        "The catalog file is refused as a whole: nothing was applied.",
    ),
    ErrorCode.SERVICE_UNAVAILABLE: CodeSpec(
        503,
        Owner.SYSTEM,
        "retry_same_key_later",
        True,
        "A service this request needs is unreachable; retry the same request after Retry-After.",
    ),
    ErrorCode.INTERNAL_ERROR: CodeSpec(
        500, Owner.SUPPORT, "retry_same_key_later", True, "Unexpected error."
    ),
}


# How every problem answer is labelled (RFC 9457).
PROBLEM_HEADERS = {"Content-Type": "application/problem+json"}


class DomainError(Exception):
    """An anticipated outcome that the API answers as problem+json."""

    def __init__(
        self,
        code: ErrorCode,
        detail: str = "",
        *,
        purchase: str | None = None,
        retry_after: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(detail or CODE_SPECS[code].title)
        self.code = code
        self.detail = detail or CODE_SPECS[code].title
        self.purchase = purchase
        if retry_after is None and CODE_SPECS[code].status == 503:
            # An outage says when to come back, whoever raised it: never a bare 503.
            retry_after = int(settings.TOLLBOOTH["UNAVAILABLE_RETRY_AFTER_SECONDS"])
        self.retry_after = retry_after
        self.extra = extra or {}

    @property
    def spec(self) -> CodeSpec:
        return CODE_SPECS[self.code]

    def as_problem(self) -> dict[str, Any]:
        """RFC 9457 body. Only what an agent can act on; never internal diagnostics."""
        spec = self.spec
        body: dict[str, Any] = {
            "type": f"urn:tollbooth:error:{self.code.value}",
            "title": spec.title,
            "status": spec.status,
            "detail": self.detail,
            "code": self.code.value,
            "purchase": self.purchase,
            "next_action": spec.next_action,
            "owner": spec.owner.value,
            "retryable": spec.retryable,
        }
        body.update(self.extra)
        return body
