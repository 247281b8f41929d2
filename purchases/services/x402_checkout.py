"""Buying an offering over x402: offer (402), verify, record, commit, broadcast, answer.

Write before broadcast: the attempt (with the signed authorization) and the purchase's
move to `paying` commit first; the relayer transaction is signed and its hash committed
next; only then does anything reach the chain. Any outcome that is not a proven success
or a proven failure is `settlement_pending`: answered 202 with the transaction named,
reconciled by tx hash and by (payer, nonce), never re-signed and never answered with a
fresh 402. A retry with the same payment id is answered from the purchase's current state.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F

from payments import services as payment_services
from payments.x402.attempts import (
    X402_SCOPE,
    x402_attempt_for_payment_id,
    x402_attempt_record,
)
from payments.x402.chain import ChainReader, ChainUnavailable
from payments.x402.networks import UnknownNetwork, network_config
from payments.x402.types import Authorization, NetworkConfig, Requirements, VerificationFailed
from payments.x402.verify import parse_authorization, verify_payment
from payments.x402.wire import MalformedPayment, decode_payment, payment_required_header
from purchases.canonical import canonical_json, fingerprint, sha256_hex
from purchases.clock import now_or
from purchases.errors import DomainError, ErrorCode
from purchases.events import Actor, event_record
from purchases.models import Buyer, BuyerWallet, Offering, Purchase, Quote
from purchases.services.checkout import purchase_create_for_quote, purchase_open_for_payment
from purchases.services.idempotency import (
    KeyClaim,
    StoredAnswer,
    payment_id_claim,
    payment_id_link_purchase,
    payment_id_release,
    payment_id_store_answer,
    payment_id_validate,
)
from purchases.services.quotes import offering_get_active, quote_create, quote_input_canonicalize
from purchases.services.x402_settlement import (
    X402Answer,
    purchase_reload,
    x402_answer_for_purchase,
    x402_requirements,
    x402_settle_attempt,
)

PROBLEM_HEADERS = {"Content-Type": "application/problem+json"}
# Answered fresh every time; never stored as the payment id's answer.
UNSTORED_CODES = {
    ErrorCode.PAYMENT_IN_FLIGHT,
    ErrorCode.PAYMENT_IDENTIFIER_CONFLICT,
    ErrorCode.VERIFICATION_UNAVAILABLE,
}
_ACCEPTED_FIELDS = [  # (wire field, requirement attribute, code when they differ)
    ("network", "network", ErrorCode.NETWORK_MISMATCH),
    ("asset", "asset", ErrorCode.ASSET_MISMATCH),
    ("payTo", "pay_to", ErrorCode.RECIPIENT_MISMATCH),
    ("amount", "amount", ErrorCode.AMOUNT_MISMATCH),
]


@dataclass(frozen=True)
class _Route:
    offering: Offering
    network: NetworkConfig


def _route(offering_slug: str) -> _Route:
    offering = offering_get_active(slug=offering_slug)
    try:
        return _Route(offering, network_config(offering.network))
    except UnknownNetwork as exc:
        raise DomainError(
            ErrorCode.OFFERING_NOT_FOUND, "This offering is not sold over x402."
        ) from exc


def _quote_anonymous(offering: Offering, raw_input: Any, now: datetime) -> Quote:
    """A fresh short-lived quote that holds no stock: free 402s can never drain stock."""
    canonical = quote_input_canonicalize(offering=offering, raw_input=raw_input)
    with transaction.atomic():
        quote = Quote.objects.create(
            offering=offering,
            buyer=None,
            quote_key=sha256_hex(secrets.token_hex(16)),
            canonical_input=canonical,
            input_hash=sha256_hex(canonical_json(canonical)),
            price=offering.price,
            asset=offering.asset,
            network=offering.network,
            pay_to=offering.pay_to,
            offering_version=offering.version,
            holds_stock=False,
            expires_at=now + timedelta(seconds=settings.X402_ANONYMOUS_QUOTE_TTL_SECONDS),
        )
        event_record(
            subject="quote",
            quote=quote,
            actor=Actor.agent("anonymous"),
            to_state=quote.state,
            evidence={"offering": offering.slug, "anonymous": True},
        )
    return quote


def x402_offer(
    *,
    offering_slug: str,
    raw_input: Any,
    buyer: Buyer | None,
    resource_url: str,
    now: datetime | None = None,
) -> X402Answer:
    """No payment yet: 402 with PAYMENT-REQUIRED naming the quote it created (or reopened).

    Raises DomainError: offering_not_found, invalid_input, sold_out.
    """
    now = now_or(now)
    route = _route(offering_slug)
    if buyer is not None:
        quote = quote_create(
            buyer=buyer, offering_slug=offering_slug, raw_input=raw_input, now=now
        ).quote
    else:
        quote = _quote_anonymous(route.offering, raw_input, now)
    header, document = payment_required_header(
        requirements=x402_requirements(quote=quote, network=route.network),
        network=route.network,
        resource_url=resource_url,
        description=route.offering.title,
    )
    error = DomainError(
        ErrorCode.PAYMENT_REQUIRED, extra={"quote": quote.public_id, "paymentRequired": document}
    )
    return X402Answer(402, error.as_problem(), {"PAYMENT-REQUIRED": header, **PROBLEM_HEADERS})


def x402_pay(
    *,
    offering_slug: str,
    payment_header: str,
    buyer: Buyer | None,
    resource_url: str,
    now: datetime | None = None,
) -> X402Answer:
    """Take a PAYMENT-SIGNATURE under the payment-id rules and settle it at most once.

    Raises DomainError (never stored): payment_signature_malformed, idempotency_key_missing,
    idempotency_key_invalid, invalid_payload, payment_in_flight, payment_identifier_conflict,
    verification_unavailable. Every other outcome is returned, and stored or live.
    """
    now = now_or(now)
    try:
        decoded = decode_payment(payment_header)
    except MalformedPayment as exc:
        raise DomainError(ErrorCode.PAYMENT_SIGNATURE_MALFORMED, str(exc)) from exc
    key = payment_id_validate(key=decoded.payment_id)
    try:
        authorization = parse_authorization(decoded.payload)
    except VerificationFailed as exc:
        raise DomainError(ErrorCode.INVALID_PAYLOAD, exc.detail) from exc
    claim = payment_id_claim(
        scope=X402_SCOPE,
        key=key,
        principal=authorization.payer.lower(),
        fingerprint=fingerprint(decoded.canonical),
        now=now,
    )
    if claim.replay is not None:
        return _replayed(claim.replay)
    try:
        answer = _pay_claimed(
            offering_slug,
            decoded.quote_id,
            decoded.accepted,
            authorization,
            key,
            fingerprint(decoded.canonical),
            buyer,
            claim,
            now,
        )
    except DomainError as error:
        if error.code in UNSTORED_CODES:
            payment_id_release(claim=claim)
            raise
        stored = StoredAnswer(
            error.spec.status, error.as_problem(), PROBLEM_HEADERS, error.purchase
        )
        payment_id_store_answer(claim=claim, answer=stored, purchase=None, now=now)
        return X402Answer(stored.status, stored.body, dict(stored.headers))
    except Exception:
        payment_id_release(claim=claim)
        raise
    return answer


def _replayed(stored: StoredAnswer) -> X402Answer:
    if stored.is_live and stored.purchase_ref:
        purchase = Purchase.objects.select_related("offering").get(ref=stored.purchase_ref)
        return x402_answer_for_purchase(purchase=purchase, reconcile=True)
    headers = dict(stored.headers)
    return X402Answer(stored.status, stored.body, headers)


def _pay_claimed(
    offering_slug: str,
    quote_id: str | None,
    accepted: dict[str, Any],
    authorization: Authorization,
    key: str,
    request_fingerprint: str,
    buyer: Buyer | None,
    claim: KeyClaim,
    now: datetime,
) -> X402Answer:
    existing = x402_attempt_for_payment_id(payment_id=key)
    if existing is not None:
        # A request holding this id died mid-way: resume from the recorded attempt.
        return _finish(existing.purchase, existing.pk, claim, now)
    route = _route(offering_slug)
    quote = _quote_named(quote_id, route.offering)
    requirements = x402_requirements(quote=quote, network=route.network)
    _check_accepted(accepted, requirements)
    reader = ChainReader(route.network)
    try:
        verify_payment(
            authorization=authorization,
            requirements=requirements,
            network=route.network,
            now=int(now.timestamp()),
            reader=reader,
        )
        verified_at_block = reader.block_number()
    except VerificationFailed as failure:
        raise DomainError(_verification_code(failure.reason_code), failure.detail) from failure
    except ChainUnavailable as exc:
        raise DomainError(ErrorCode.VERIFICATION_UNAVAILABLE) from exc
    purchase, attempt_id = _record(
        quote, authorization, key, request_fingerprint, buyer, claim, now, verified_at_block
    )
    return _finish(purchase, attempt_id, claim, now)


def _finish(purchase: Purchase, attempt_id: int, claim: KeyClaim, now: datetime) -> X402Answer:
    x402_settle_attempt(attempt_id=attempt_id, now=now)
    purchase = purchase_reload(purchase=purchase)
    answer = x402_answer_for_purchase(purchase=purchase, reconcile=False)
    is_failed = purchase.payment_state == Purchase.PaymentState.FAILED
    stored = StoredAnswer(
        answer.status,
        answer.body if is_failed else None,
        answer.headers if is_failed else {},
        purchase.ref,
        is_live=not is_failed,
    )
    payment_id_store_answer(claim=claim, answer=stored, purchase=purchase, now=now)
    return answer


def _quote_named(quote_id: str | None, offering: Offering) -> Quote:
    quote = Quote.objects.filter(public_id=quote_id or "", offering=offering).first()
    if quote is None:
        raise DomainError(
            ErrorCode.QUOTE_NOT_FOUND, "accepted.extra.quote names no quote of this offering."
        )
    return quote


def _check_accepted(accepted: dict[str, Any], requirements: Requirements) -> None:
    """The requirements the client signed against must be the ones we offered."""
    if accepted.get("scheme") != "exact":
        raise DomainError(ErrorCode.UNSUPPORTED_SCHEME)
    for wire_field, attribute, code in _ACCEPTED_FIELDS:
        if (
            str(accepted.get(wire_field, "")).lower()
            != str(getattr(requirements, attribute)).lower()
        ):
            raise DomainError(code, f"accepted.{wire_field} differs from what was offered.")


def _verification_code(reason_code: str) -> ErrorCode:
    try:
        return ErrorCode(reason_code)
    except ValueError:
        return ErrorCode.INVALID_PAYLOAD


def _record(
    quote: Quote,
    authorization: Authorization,
    key: str,
    request_fingerprint: str,
    buyer: Buyer | None,
    claim: KeyClaim,
    now: datetime,
    verified_at_block: int,
) -> tuple[Purchase, int]:
    """One transaction: the attempt with its authorization, and the purchase moved to paying.

    Raises DomainError: quote_already_paid, quote_expired, spend_cap_exceeded, sold_out.
    """
    actor = Actor.agent(authorization.payer.lower())
    with transaction.atomic():
        quote = (
            Quote.objects.select_for_update(of=("self",))
            .select_related("offering")
            .get(pk=quote.pk)
        )
        purchase = _purchase_for_x402(quote, authorization, buyer, now, actor)
        attempt = x402_attempt_record(
            purchase=purchase,
            authorization=authorization,
            payment_id=key,
            fingerprint=request_fingerprint,
            network=quote.network,
            asset=quote.asset,
            actor=actor,
            search_from_block=verified_at_block,
        )
        previous = purchase.payment_state
        purchase.payment_begin()
        purchase.rail, purchase.payer = Purchase.Rail.X402, authorization.payer.lower()
        purchase.save(update_fields=["payment_state", "reason_code", "rail", "payer", "updated_at"])
        event_record(
            subject="purchase.payment",
            purchase=purchase,
            actor=actor,
            from_state=previous,
            to_state=purchase.payment_state,
            evidence={"attempt": attempt.pk},
        )
        payment_id_link_purchase(claim=claim, purchase=purchase)
    return purchase, attempt.pk


def _purchase_for_x402(
    quote: Quote, authorization: Authorization, buyer: Buyer | None, now: datetime, actor: Actor
) -> Purchase:
    purchase = purchase_open_for_payment(quote=quote, now=now)
    capped = buyer or quote.buyer or _wallet_owner(authorization.payer)
    if capped is not None:
        # Spend caps bind the paying wallet's owner whichever rail it pays on.
        payment_services.spend_cap_check(
            buyer=capped,
            amount=quote.price,
            now=now,
            purchase_ref=purchase.ref if purchase else None,
        )
    if purchase is not None:
        return purchase
    if not quote.holds_stock and quote.offering.stock is not None:
        _reserve_stock(quote)
    return purchase_create_for_quote(
        quote=quote,
        buyer=buyer or quote.buyer,
        rail=Purchase.Rail.X402,
        payer=authorization.payer.lower(),
        actor=actor,
    )


def _wallet_owner(address: str) -> Buyer | None:
    wallet = BuyerWallet.objects.select_related("buyer").filter(address=address.lower()).first()
    return wallet.buyer if wallet else None


def _reserve_stock(quote: Quote) -> None:
    """Anonymous quotes hold nothing; stock is taken only when a valid payment arrives."""
    taken = Offering.objects.filter(pk=quote.offering_id, stock__gt=0).update(stock=F("stock") - 1)
    if not taken:
        raise DomainError(ErrorCode.SOLD_OUT)
    quote.holds_stock = True
