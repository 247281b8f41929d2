"""Paying for an offering over x402: key, verify, deduplicate, record, commit, broadcast, answer.

Every payment is keyed: by the client's payment id when it sends one, otherwise by what its
signature makes unique, `(network, payer, EIP-3009 nonce)`. The same PAYMENT-SIGNATURE
resent gets the stored (or live) answer; in flight it gets 409.

A fresh authorization for what the same payer already paid or is paying (same offering,
canonical input, API key and copy label, inside the offering's duplicate window) is answered
with that purchase and never broadcast: stock clients re-sign on every retry.

Write before broadcast: the attempt (with the signed authorization) and the purchase's
move to `paying` commit first; the relayer transaction is signed and its hash committed
next; only then does anything reach the chain. Any outcome that is not a proven success
or a proven failure is `settlement_pending`: answered 202 with the transaction named,
reconciled by tx hash and by (payer, nonce), never re-signed and never answered with a
fresh 402.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction

from core.actors import Actor
from core.canonical import fingerprint, sha256_hex
from core.clock import now_or
from core.errors import DomainError, ErrorCode
from payments.models import Rail
from payments.x402.attempts import (
    X402_SCOPE,
    x402_attempt_for_authorization,
    x402_attempt_for_key,
    x402_attempt_record,
)
from payments.x402.chain import ChainReader, ChainUnavailable
from payments.x402.types import Authorization, Requirements, VerificationFailed
from payments.x402.verify import (
    parse_authorization,
    verify_payment_offline,
    verify_payment_on_chain,
)
from payments.x402.wire import DecodedPayment, MalformedPayment, decode_payment
from purchases.events import event_record, event_record_change, events_batched
from purchases.models import Buyer, BuyerWallet, IdempotencyRecord, Offering, Purchase, Quote
from purchases.selectors import purchase_capability_url
from purchases.services.buyers import buyer_spend_cap_check
from purchases.services.checkout import purchase_create_for_quote, purchase_open_for_payment
from purchases.services.duplicates import (
    DUPLICATE_HEADER,
    copy_label_validate,
    duplicate_guard_lock,
    duplicate_key_for,
    purchase_duplicate_find,
    purchase_duplicate_record,
    quote_release_if_unpaid,
)
from purchases.services.idempotency import (
    PAYMENT_ID_PATTERN,
    KeyClaim,
    KeyedRequest,
    StoredAnswer,
    idempotent_request,
    payment_id_mark_recorded,
    payment_id_store_answer,
)
from purchases.services.offerings import offering_stock_take
from purchases.services.x402_offers import X402Route, x402_route
from purchases.services.x402_settlement import (
    X402Answer,
    purchase_reload,
    x402_answer_for_purchase,
    x402_requirements,
    x402_settle_attempt,
)

# Answered fresh every time; never stored as the payment id's answer.
UNSTORED_CODES = frozenset(
    {
        ErrorCode.PAYMENT_IN_FLIGHT,
        ErrorCode.PAYMENT_IDENTIFIER_CONFLICT,
        ErrorCode.VERIFICATION_UNAVAILABLE,
        ErrorCode.AUTHORIZATION_IN_USE,
    }
)
_ACCEPTED_FIELDS = [  # (wire field, requirement attribute, code when they differ)
    ("network", "network", ErrorCode.NETWORK_MISMATCH),
    ("asset", "asset", ErrorCode.ASSET_MISMATCH),
    ("payTo", "pay_to", ErrorCode.RECIPIENT_MISMATCH),
    ("amount", "amount", ErrorCode.AMOUNT_MISMATCH),
]
# A payment without a client id is keyed by its authorization; ':' keeps these apart
# from client ids, which are [A-Za-z0-9_-] only.
AUTHORIZATION_KEY_PREFIX = "auth:"


@dataclass(frozen=True)
class _PayRequest:
    """One PAYMENT-SIGNATURE presentation, decoded and keyed."""

    offering_slug: str
    decoded: DecodedPayment
    authorization: Authorization
    key: str
    fingerprint: str
    buyer: Buyer | None
    copy_label: str
    now: datetime

    @property
    def actor(self) -> Actor:
        return Actor.agent(self.authorization.payer.lower())


class _Duplicate(Exception):
    def __init__(self, purchase: Purchase) -> None:
        super().__init__(purchase.ref)
        self.purchase = purchase


def x402_payment_key(*, decoded: DecodedPayment, authorization: Authorization) -> str:
    """The client's payment id, or `auth:` + SHA-256 of (network, payer, nonce).

    Raises DomainError: payment_identifier_invalid.
    """
    client_id = _client_payment_id(decoded)
    if client_id is not None:
        return client_id
    network = str(decoded.accepted.get("network", ""))
    unique = f"{network}|{authorization.payer.lower()}|{authorization.nonce.lower()}"
    return AUTHORIZATION_KEY_PREFIX + sha256_hex(unique)


def _client_payment_id(decoded: DecodedPayment) -> str | None:
    """Raises DomainError: payment_identifier_invalid."""
    client_id = decoded.payment_id
    if client_id is None or client_id == "":
        return None
    if not isinstance(client_id, str) or not PAYMENT_ID_PATTERN.fullmatch(client_id):
        raise DomainError(ErrorCode.PAYMENT_IDENTIFIER_INVALID)
    return client_id


def x402_pay(
    *,
    offering_slug: str,
    payment_header: str,
    buyer: Buyer | None,
    copy_label: str | None = None,
    now: datetime | None = None,
) -> X402Answer:
    """Take a PAYMENT-SIGNATURE under the payment-id rules and settle it at most once.

    Raises DomainError (never stored): payment_signature_malformed, payment_identifier_invalid,
    copy_label_invalid, invalid_payload, payment_in_flight, payment_identifier_conflict,
    verification_unavailable. Every other outcome is returned, and stored or live.
    """
    request = _pay_request(offering_slug, payment_header, buyer, copy_label, now_or(now))
    return idempotent_request(
        request=KeyedRequest(
            scope=X402_SCOPE,
            key=request.key,
            principal=request.authorization.payer.lower(),
            fingerprint=request.fingerprint,
            now=request.now,
            unstored=UNSTORED_CODES,
        ),
        work=lambda claim: _pay_claimed(request, claim),
        render=lambda stored, is_replay: _replayed(stored) if is_replay else _as_sent(stored),
    )


def _pay_request(
    offering_slug: str, header: str, buyer: Buyer | None, copy_label: str | None, now: datetime
) -> _PayRequest:
    label = copy_label_validate(label=copy_label)
    try:
        decoded = decode_payment(header)
    except MalformedPayment as exc:
        raise DomainError(ErrorCode.PAYMENT_SIGNATURE_MALFORMED, str(exc)) from exc
    _client_payment_id(decoded)  # a malformed id is named before the payload is judged
    try:
        authorization = parse_authorization(decoded.payload)
    except VerificationFailed as exc:
        raise DomainError(ErrorCode.INVALID_PAYLOAD, exc.detail) from exc
    key = x402_payment_key(decoded=decoded, authorization=authorization)
    return _PayRequest(
        offering_slug,
        decoded,
        authorization,
        key,
        fingerprint(decoded.canonical),
        buyer,
        label,
        now,
    )


def _replayed(stored: StoredAnswer) -> X402Answer:
    if stored.is_live and stored.purchase_ref:
        purchase = Purchase.objects.select_related("offering").get(ref=stored.purchase_ref)
        answer = x402_answer_for_purchase(purchase=purchase, reconcile=True)
        return X402Answer(
            answer.status, answer.body, {**answer.headers, **stored.headers}, answer.content_type
        )
    return _as_sent(stored)


def _as_sent(stored: StoredAnswer) -> X402Answer:
    """A stored answer, byte for byte as it was first sent."""
    headers = dict(stored.headers)
    content_type = headers.pop("Content-Type", "application/json")
    return X402Answer(stored.status, stored.raw or b"", headers, content_type=content_type)


def _pay_claimed(request: _PayRequest, claim: KeyClaim) -> X402Answer:
    if claim.recovery_point == IdempotencyRecord.RecoveryPoint.PAYMENT_RECORDED:
        # A request holding this id died after recording the payment: resume there.
        existing = x402_attempt_for_key(idempotency_record_id=claim.record_id)
        if existing is not None:
            return _finish(existing.purchase, existing.pk, claim, request.now)
    route = x402_route(offering_slug=request.offering_slug)
    quote = _quote_named(request.decoded.quote_id, route.offering, request)
    requirements = x402_requirements(quote=quote, network=route.network)
    _check_accepted(request.decoded.accepted, requirements)
    _refuse_if_authorization_in_use(request, quote.network)
    try:
        duplicate_key = _verify(request, route, requirements, quote)
        purchase, attempt_id = _record(request, quote, duplicate_key, claim, _verified_at(route))
    except _Duplicate as duplicate:
        return _answer_duplicate(request, duplicate.purchase, quote, claim)
    return _finish(purchase, attempt_id, claim, request.now)


def _refuse_if_authorization_in_use(request: _PayRequest, network: str) -> None:
    """One authorization pays one purchase: a second presentation (another payment id, or
    another quote) is refused before anything is verified or broadcast.

    Raises DomainError: authorization_in_use, naming the purchase it already pays.
    """
    taken = x402_attempt_for_authorization(
        network=network,
        payer=request.authorization.payer,
        nonce=request.authorization.nonce,
    )
    if taken is not None:
        raise DomainError(ErrorCode.AUTHORIZATION_IN_USE, purchase=taken.purchase.ref)


def _verify(
    request: _PayRequest, route: X402Route, requirements: Requirements, quote: Quote
) -> str:
    """Check the payment, off chain first; a duplicate is answered before any RPC.

    Returns the purchase's duplicate key. Raises DomainError (a verification code, or
    verification_unavailable) and _Duplicate.
    """
    try:
        verify_payment_offline(
            authorization=request.authorization,
            requirements=requirements,
            network=route.network,
            now=int(request.now.timestamp()),
        )
    except VerificationFailed as failure:
        raise DomainError(_verification_code(failure.reason_code), failure.detail) from failure
    duplicate_key = duplicate_key_for(
        payer=request.authorization.payer,
        buyer_ref=request.buyer.ref if request.buyer else None,
        offering=route.offering,
        input_hash=quote.input_hash,
        copy_label=request.copy_label,
    )
    duplicate = purchase_duplicate_find(
        offering=route.offering, duplicate_key=duplicate_key, now=request.now
    )
    if duplicate is not None:
        raise _Duplicate(duplicate)
    try:
        verify_payment_on_chain(
            authorization=request.authorization, reader=ChainReader(route.network)
        )
    except VerificationFailed as failure:
        raise DomainError(_verification_code(failure.reason_code), failure.detail) from failure
    except ChainUnavailable as exc:
        raise DomainError(ErrorCode.VERIFICATION_UNAVAILABLE) from exc
    return duplicate_key


def _verified_at(route: X402Route) -> int:
    """The chain head after verification: the transfer cannot land in an older block."""
    try:
        return ChainReader(route.network).block_number()
    except ChainUnavailable as exc:
        raise DomainError(ErrorCode.VERIFICATION_UNAVAILABLE) from exc


def _answer_duplicate(
    request: _PayRequest, purchase: Purchase, quote: Quote, claim: KeyClaim
) -> X402Answer:
    """Answer a re-signed retry with the purchase it repeats; its authorization is never sent.

    Raises DomainError: payment_in_flight while the purchase's own request still runs.
    """
    if _payment_in_flight(purchase, request.now):
        raise DomainError(
            ErrorCode.PAYMENT_IN_FLIGHT,
            purchase=purchase.ref,
            retry_after=settings.TOLLBOOTH["RETRY_AFTER_SECONDS"],
            extra={"status_url": purchase_capability_url(purchase=purchase)},
        )
    marker = {DUPLICATE_HEADER: purchase.ref}
    with transaction.atomic():
        purchase_duplicate_record(
            purchase=purchase,
            actor=request.actor,
            rail="x402",
            evidence={
                "payer": request.authorization.payer.lower(),
                "nonce": request.authorization.nonce,
                "valid_before": request.authorization.valid_before,
                "quote": quote.public_id,
                "copy_label": request.copy_label,
            },
        )
        quote_release_if_unpaid(quote=quote, actor=request.actor)
        stored = StoredAnswer(200, None, marker, purchase.ref, is_live=True)
        payment_id_store_answer(claim=claim, answer=stored, purchase=purchase, now=request.now)
    answer = x402_answer_for_purchase(purchase=purchase, reconcile=True)
    return X402Answer(answer.status, answer.body, {**answer.headers, **marker}, answer.content_type)


def _payment_in_flight(purchase: Purchase, now: datetime) -> bool:
    return (
        purchase.payment_state == Purchase.PaymentState.PAYING
        and IdempotencyRecord.objects.filter(
            purchase=purchase, state=IdempotencyRecord.State.IN_FLIGHT, locked_until__gt=now
        ).exists()
    )


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
    return _as_sent(stored) if is_failed else answer


def _quote_named(quote_id: str | None, offering: Offering, request: _PayRequest) -> Quote:
    """The quote the payment names, if this payer may pay it.

    A quote opened with an API key is its buyer's: paid with that key, or without a key from
    a wallet registered to that buyer. Anyone else's payment never touches it (nor learns it
    exists). Raises DomainError: quote_not_found.
    """
    quote = Quote.objects.filter(public_id=quote_id or "", offering=offering).first()
    if quote is None or not _may_pay(quote, request):
        raise DomainError(
            ErrorCode.QUOTE_NOT_FOUND, "accepted.extra.quote names no quote of this offering."
        )
    quote.offering = offering  # already read: no second query for it
    return quote


def _may_pay(quote: Quote, request: _PayRequest) -> bool:
    if quote.buyer_id is None:
        return True  # an anonymous quote: whoever pays it first
    if request.buyer is not None:
        return request.buyer.pk == quote.buyer_id
    return BuyerWallet.objects.filter(
        buyer_id=quote.buyer_id, address=request.authorization.payer.lower()
    ).exists()


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
    request: _PayRequest, quote: Quote, duplicate_key: str, claim: KeyClaim, verified_at_block: int
) -> tuple[Purchase, int]:
    """One transaction: the attempt with its authorization, and the purchase moved to paying.

    Racing fresh authorizations for one duplicate key serialize on its guard row: the first
    records, the others find its purchase and raise _Duplicate.
    Raises DomainError: quote_already_paid, quote_expired, spend_cap_exceeded, sold_out.
    """
    try:
        return _record_once(request, quote, duplicate_key, claim, verified_at_block)
    except IntegrityError as exc:
        # Two presentations of one authorization raced past the look-up: the database
        # constraint lets exactly one through; this one names the winner's purchase.
        if "authorization" not in str(exc):
            raise
        _refuse_if_authorization_in_use(request, quote.network)
        raise


def _record_once(
    request: _PayRequest, quote: Quote, duplicate_key: str, claim: KeyClaim, verified_at_block: int
) -> tuple[Purchase, int]:
    authorization, actor = request.authorization, request.actor
    with transaction.atomic(), events_batched():
        if quote.offering.duplicate_window:
            duplicate_guard_lock(duplicate_key=duplicate_key)
            duplicate = purchase_duplicate_find(
                offering=quote.offering, duplicate_key=duplicate_key, now=request.now
            )
            if duplicate is not None:
                raise _Duplicate(duplicate)
        quote = (
            Quote.objects.select_for_update(of=("self",))
            .select_related("offering")
            .get(pk=quote.pk)
        )
        purchase = _purchase_for_x402(quote, authorization, request.buyer, request.now, actor)
        attempt, change = x402_attempt_record(
            purchase_id=purchase.pk,
            authorization=authorization,
            idempotency_record_id=claim.record_id,
            fingerprint=request.fingerprint,
            network=quote.network,
            asset=quote.asset,
            search_from_block=verified_at_block,
        )
        event_record_change(purchase=purchase, actor=actor, change=change)
        previous = purchase.payment_state
        purchase.payment_begin()
        purchase.rail, purchase.payer = Rail.X402, authorization.payer.lower()
        purchase.duplicate_key = duplicate_key
        purchase.save(
            update_fields=[
                "payment_state",
                "reason_code",
                "rail",
                "payer",
                "duplicate_key",
                "updated_at",
            ]
        )
        event_record(
            subject="purchase.payment",
            purchase=purchase,
            actor=actor,
            from_state=previous,
            to_state=purchase.payment_state,
            evidence={"attempt": attempt.pk},
        )
        payment_id_mark_recorded(claim=claim, purchase=purchase)
    return purchase, attempt.pk


def _purchase_for_x402(
    quote: Quote, authorization: Authorization, buyer: Buyer | None, now: datetime, actor: Actor
) -> Purchase:
    purchase = purchase_open_for_payment(quote=quote, now=now)
    capped = buyer or quote.buyer or _wallet_owner(authorization.payer)
    if capped is not None:
        # Spend caps bind the paying wallet's owner whichever rail it pays on.
        buyer_spend_cap_check(
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
        rail=Rail.X402,
        payer=authorization.payer.lower(),
        actor=actor,
    )


def _wallet_owner(address: str) -> Buyer | None:
    wallet = BuyerWallet.objects.select_related("buyer").filter(address=address.lower()).first()
    return wallet.buyer if wallet else None


def _reserve_stock(quote: Quote) -> None:
    """Anonymous quotes hold nothing; stock is taken only when a valid payment arrives."""
    if not offering_stock_take(offering_id=quote.offering_id):
        raise DomainError(ErrorCode.SOLD_OUT)
    quote.holds_stock = True
