"""Re-access by wallet sign-in: a payer that bought a result over x402 fetches it again,
within the result's retention, by signing in with its wallet (the x402 extension
sign-in-with-x, declared in every quoted 402) instead of paying again.

The challenge binds the paid URL, its host, the offering's network and the input it was
issued for (payments.rails.x402.sign_in); the request that carries the proof sends that input
again, as the official clients do. The signer must be the payer of a settled purchase of
that offering for the same canonical input whose result is still kept (or still being
made: then the pending answer). Each nonce is honoured once: the WalletSignIn row with its
unique index, kept until the challenge expires. Anything else is refused, and the paid URL
answers as if no proof came (the ordinary 402, saying why), so a client falls back to
paying, as the extension says it does.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Lower
from prometheus_client import Counter

from core.actors import Actor
from core.bulk import insert_unless_conflict
from core.canonical import canonical_json, sha256_hex
from core.clock import now_or
from payments.models import Rail
from payments.rails.x402.sign_in import SignIn, SignInRefused, sign_in_verify
from purchases import event_subjects as subjects
from purchases.events import event_record
from purchases.models import Offering, Purchase, WalletSignIn
from purchases.selectors import PENDING_RUN_STATES
from purchases.services.quote.quotes import quote_input_canonicalize
from purchases.services.x402.offers import input_from_query, sign_in_binding, x402_route
from purchases.services.x402.outcomes import (
    X402Outcome,
    x402_outcome_for_purchase,
    x402_request_scope,
)

__all__ = ["SignInRefused", "wallet_sign_ins_prune", "x402_sign_in"]

RUN = Purchase.FulfillmentState
CHANNEL = "wallet_sign_in"
HONOURED = "honoured"
# Per process. Outcomes are a closed set (honoured, or a refusal's reason code).
wallet_sign_ins = Counter(
    "tollbooth_wallet_sign_ins_total",
    "Wallet sign-in proofs (sign-in-with-x) at the paid URLs: honoured, or why refused.",
    ["outcome"],
)


def x402_sign_in(
    *,
    offering_slug: str,
    header: str,
    raw_input: Any,
    resource_url: str,
    from_query: bool = False,
    now: datetime | None = None,
) -> X402Outcome:
    """Answer a SIGN-IN-WITH-X proof with the purchase it signs in to, without payment.

    `raw_input`: the request's input (a JSON body, or with `from_query` the query string's
    values). Raises SignInRefused (its `reason` a stable code: the SDK's invalid_siwx_*,
    siwx_not_purchased when the signer has no settled purchase of this input whose result
    is still kept), and DomainError: offering_not_found, invalid_input, input_too_large.
    """
    try:
        outcome = _sign_in(offering_slug, header, raw_input, resource_url, from_query, now)
    except SignInRefused as refused:
        wallet_sign_ins.labels(outcome=refused.reason).inc()
        raise
    wallet_sign_ins.labels(outcome=HONOURED).inc()
    return outcome


def _sign_in(
    offering_slug: str,
    header: str,
    raw_input: Any,
    resource_url: str,
    from_query: bool,
    now: datetime | None,
) -> X402Outcome:
    now = now_or(now)
    if settings.X402_SIGN_IN_TTL_SECONDS <= 0:
        raise SignInRefused("siwx_not_offered", "This server does not offer wallet sign-in.")
    offering = x402_route(offering_slug=offering_slug).offering
    if from_query:
        raw_input = input_from_query(offering, raw_input)
    canonical = quote_input_canonicalize(offering=offering, raw_input=raw_input)
    input_hash = sha256_hex(canonical_json(canonical))
    signed = sign_in_verify(
        header=header,
        domain=urlsplit(resource_url).netloc,
        uri=resource_url,
        chain_id=offering.network,
        binding=sign_in_binding(offering=offering, input_hash=input_hash),
        now=now,
    )
    purchase = _purchase_signed_in_to(offering, signed.address, input_hash, now)
    if purchase is None:
        raise SignInRefused(
            "siwx_not_purchased",
            "This wallet has no settled purchase of this input whose result is still kept.",
        )
    _sign_in_record(purchase, signed, now)
    with x402_request_scope(offering=offering):
        return x402_outcome_for_purchase(purchase=purchase, reconcile=True, channel=CHANNEL)


def _purchase_signed_in_to(
    offering: Offering, address: str, input_hash: str, now: datetime
) -> Purchase | None:
    """The payer's latest settled x402 purchase of this input with a result still kept, or
    whose work is still under way (paid: the answer is then its pending 202)."""
    return (
        Purchase.objects.select_related("offering")
        # Lower(payer) is indexed (purchase_payer_lower_scale): the admin's wallet search.
        .alias(payer_lower=Lower("payer"))
        .filter(
            payer_lower=address.lower(),
            offering=offering,
            rail=Rail.X402,
            payment_state=Purchase.PaymentState.PAID,
            quote__input_hash=input_hash,
        )
        .filter(
            Q(fulfillment_state__in=PENDING_RUN_STATES)
            | Q(fulfillment_state=RUN.SUCCEEDED, result__expires_at__gt=now)
        )
        .order_by("-pk")
        .first()
    )


def _sign_in_record(purchase: Purchase, signed: SignIn, now: datetime) -> None:
    """Use the nonce (once: a replay finds it taken) and put the sign-in on the timeline.

    Raises SignInRefused: invalid_siwx_nonce (already used).
    """
    row = WalletSignIn(
        nonce=signed.nonce,
        address=signed.address,
        purchase=purchase,
        created_at=now,
        expires_at=signed.expires_at,
    )
    with transaction.atomic():
        if not insert_unless_conflict(row, conflict="(nonce)"):
            raise SignInRefused("invalid_siwx_nonce", "This challenge was used already.")
        event_record(
            subject=subjects.RESULT_REACCESSED,
            purchase=purchase,
            actor=Actor.agent(signed.address),
            reason_code="wallet_sign_in",
            evidence={
                "address": signed.address,
                "nonce": signed.nonce,
                "chain_id": signed.chain_id,
                "domain": signed.domain,
                "uri": signed.uri,
                "issued_at": signed.issued_at.isoformat(),
            },
        )


def wallet_sign_ins_prune(*, now: datetime, batch: int = 5000) -> int:
    """Delete used nonces whose challenge has expired (a proof for it is refused by its
    expiry already), batch by batch. Returns rows deleted."""
    pruned = 0
    while True:
        ids = list(
            WalletSignIn.objects.filter(expires_at__lt=now).values_list("pk", flat=True)[:batch]
        )
        pruned += WalletSignIn.objects.filter(pk__in=ids).delete()[0] if ids else 0
        if len(ids) < batch:
            return pruned
