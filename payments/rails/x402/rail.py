"""The x402 rail: an EIP-3009 authorization the buyer signed, put on chain by our relayer
(direct) or a facilitator, and looked up by tx hash and by (payer, nonce).

Write before broadcast: `record` writes the attempt with the signed authorization; `settle`
claims the first broadcast, commits the relayer transaction's hash (direct mode) and only
then sends it. Whatever is sent again (`resend`) is only ever that same signed
authorization: the identical relayer bytes, or the same payload to the facilitator.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime
from itertools import groupby
from typing import Any, ClassVar

from django.conf import settings
from django.utils import timezone

from core.canonical import fingerprint, sha256_hex
from core.changes import Change
from core.errors import DomainError, ErrorCode
from core.refs import PAYMENT_ID_PATTERN
from core.waits import Awaiting, waited_out
from payments.models import PENDING_ATTEMPT_STATES, PaymentAttempt, Rail, Refund
from payments.rails.base import (
    FACILITATOR_PAYMENT_ID,
    FIRST_BROADCAST,
    REPLACED_SUBMISSION,
    BatchLookup,
    Charge,
    FundsLow,
    Presentation,
    QuoteTerms,
    RowGuard,
    SettlementOutcome,
    SettlementStatus,
    Settling,
)
from payments.rails.x402.attempts import (
    x402_attempt_authorization,
    x402_attempt_claim_first_broadcast,
    x402_attempt_claim_resubmission,
    x402_attempt_for_authorization,
    x402_attempt_mark_prepared,
    x402_attempt_prepared,
    x402_attempt_record,
    x402_attempt_replace_prepared,
)
from payments.rails.x402.batch import DEFAULT_CHUNK_SIZE, BatchChainReader
from payments.rails.x402.chain import ChainReader, ChainUnavailable
from payments.rails.x402.context import X402Context
from payments.rails.x402.direct import RELAYER_NONCE_TAKEN, BroadcastNotPrepared
from payments.rails.x402.facilitator import FacilitatorRefused
from payments.rails.x402.gas import relayer_gas_unable, relayer_gas_watch
from payments.rails.x402.lookup import settlement_lookup
from payments.rails.x402.networks import network_config, relayer_networks
from payments.rails.x402.types import (
    Authorization,
    NetworkConfig,
    PreparedBroadcast,
    Requirements,
    VerificationFailed,
)
from payments.rails.x402.verify import (
    SETTLEMENT_MARGIN_SECONDS,
    parse_authorization,
    verify_payment_funds,
    verify_payment_offline,
)
from payments.rails.x402.wire import DecodedPayment, MalformedPayment, decode_payment
from payments.services import refund_record

logger = logging.getLogger(__name__)

# A payment without a client id is keyed by its authorization; ':' keeps these apart from
# client ids, which are [A-Za-z0-9_-] only.
AUTHORIZATION_KEY_PREFIX = "auth:"
_ACCEPTED_FIELDS = [  # (wire field, requirement attribute, code when they differ)
    ("network", "network", ErrorCode.NETWORK_MISMATCH),
    ("asset", "asset", ErrorCode.ASSET_MISMATCH),
    ("payTo", "pay_to", ErrorCode.RECIPIENT_MISMATCH),
    ("amount", "amount", ErrorCode.AMOUNT_MISMATCH),
]


def x402_presentation(*, header: str) -> Presentation:
    """A PAYMENT-SIGNATURE header, decoded and keyed: by the client's payment id when it sends
    one, otherwise by `auth:` + SHA-256 of (network, payer, nonce), which the chain makes
    single-use.

    Raises DomainError: payment_signature_malformed, payment_identifier_invalid (named before
    the payload is judged), invalid_payload.
    """
    try:
        decoded = decode_payment(header)
    except MalformedPayment as exc:
        raise DomainError(ErrorCode.PAYMENT_SIGNATURE_MALFORMED, str(exc)) from exc
    client_id = _client_payment_id(decoded)
    try:
        authorization = parse_authorization(decoded.payload)
    except VerificationFailed as exc:
        raise DomainError(ErrorCode.INVALID_PAYLOAD, exc.detail) from exc
    network = str(decoded.accepted.get("network", ""))
    unique = f"{network}|{authorization.payer.lower()}|{authorization.nonce.lower()}"
    return Presentation(
        rail=Rail.X402,
        key=client_id or AUTHORIZATION_KEY_PREFIX + sha256_hex(unique),
        payer=authorization.payer.lower(),
        fingerprint=fingerprint(decoded.canonical),
        quote_id=decoded.quote_id,
        evidence=authorization,
        accepted=decoded.accepted,
        summary={
            "payer": authorization.payer.lower(),
            "nonce": authorization.nonce,
            "valid_before": authorization.valid_before,
        },
    )


def x402_paid_terms(*, presentation: Presentation) -> dict[str, str]:
    """What a payment pays, as offered (`accepted`) and as signed (the authorization's `to`
    and `value`), without what makes one signature differ from the next (nonce, window,
    signature): two authorizations for the same terms give the same dict."""
    accepted = presentation.accepted or {}
    authorization: Authorization = presentation.evidence
    return {
        "scheme": str(accepted.get("scheme", "")),
        "network": str(accepted.get("network", "")),
        "asset": str(accepted.get("asset", "")).lower(),
        "payTo": str(accepted.get("payTo", "")).lower(),
        "amount": str(accepted.get("amount", "")),
        "to": authorization.to.lower(),
        "value": str(authorization.value),
    }


def _client_payment_id(decoded: DecodedPayment) -> str | None:
    """Raises DomainError: payment_identifier_invalid."""
    client_id = decoded.payment_id
    if client_id is None or client_id == "":
        return None
    if not isinstance(client_id, str) or not PAYMENT_ID_PATTERN.fullmatch(client_id):
        raise DomainError(ErrorCode.PAYMENT_IDENTIFIER_INVALID)
    return client_id


# The x402 payment flow that is the wire default (x402 #3053): never written in `extra`.
AUTHORIZATION = "authorization"


def x402_requirements(*, terms: QuoteTerms, network: NetworkConfig) -> Requirements:
    """The `accepts` entry a quote stands for (quote_id "" : the price-only offer)."""
    return Requirements(
        network=terms.network,
        asset=terms.asset,
        amount=terms.amount,
        pay_to=terms.pay_to,
        max_timeout_seconds=terms.max_timeout_seconds or network.max_timeout_seconds,
        quote_id=terms.quote_id or None,
        # Stated so an agent can tell a re-signed retry will not be charged again, and (the
        # flow) whether it is charged before the work runs.
        terms=(
            ("duplicateWindowSeconds", terms.duplicate_window_seconds),
            *(
                (("paymentFlow", terms.payment_flow),)
                if terms.payment_flow != "authorization"
                else ()
            ),
        ),
    )


class X402Rail:
    name: ClassVar[str] = Rail.X402
    settles_when_recorded: ClassVar[bool] = False

    def requirements(self, *, terms: QuoteTerms) -> Requirements:
        return x402_requirements(terms=terms, network=network_config(terms.network))

    def verify(
        self, *, presentation: Presentation, terms: QuoteTerms, now: datetime
    ) -> X402Context:
        """The signed terms are the ones we offered, the authorization pays nothing else yet,
        and its signature and window hold. No RPC. Returns the attempt's context (network,
        settler, authorization), derived here once for the whole request.

        Raises DomainError: unsupported_scheme, a *_mismatch code, authorization_in_use
        (naming the purchase it already pays), or a verification code.
        """
        context = _context_of_presentation(presentation, terms)
        requirements = x402_requirements(terms=terms, network=context.network)
        _check_accepted(presentation.accepted or {}, requirements)
        if not presentation.key.startswith(AUTHORIZATION_KEY_PREFIX):
            # Keyed by the authorization itself, the payment id is already its only live use
            # (one key, one claim). A client's id may present one another id already pays.
            self.refuse_if_taken(presentation=presentation, terms=terms)
        try:
            verify_payment_offline(
                authorization=context.authorization,
                requirements=requirements,
                network=context.network,
                now=int(now.timestamp()),
            )
        except VerificationFailed as failure:
            raise DomainError(_verification_code(failure.reason_code), failure.detail) from failure
        return context

    def refuse_if_taken(self, *, presentation: Presentation, terms: QuoteTerms) -> None:
        """Raises DomainError: authorization_in_use, naming the purchase it already pays."""
        authorization: Authorization = presentation.evidence
        taken = x402_attempt_for_authorization(
            network=terms.network, payer=authorization.payer, nonce=authorization.nonce
        )
        if taken is not None:
            raise DomainError(ErrorCode.AUTHORIZATION_IN_USE, purchase=taken.purchase.ref)

    def verify_funds(
        self, *, presentation: Presentation, terms: QuoteTerms, context: Any = None
    ) -> int:
        """Nonce unused and balance sufficient, on chain. Returns the chain head after the
        check: the transfer cannot land in an older block, so look-ups start there.

        A facilitator that settles the network is asked (/verify) too, and its answer kept
        for the first broadcast.

        Raises DomainError: authorization_used, insufficient_balance, verification_unavailable,
        authorization_in_use when the nonce was used by our own payment of it, or
        facilitator_credentials_refused (the facilitator refused our credentials: 401/403);
        settlement_unavailable first, with no RPC call, when beat's last reading (read from
        the shared cache) says our relayer cannot pay one settlement's gas
        (payments.rails.x402.gas; unknown passes).
        """
        known: X402Context = context or _context_of_presentation(presentation, terms)
        _refuse_without_gas(known.network)
        reader = ChainReader(known.network)
        try:
            head = verify_payment_funds(authorization=known.authorization, reader=reader)
        except VerificationFailed as failure:
            if failure.reason_code == "authorization_used":
                # Another payment id raced this one past `verify` and its transfer has landed
                # since: the nonce is spent by a purchase of ours, which this answer names
                # (in flight, never stored), as the attempt's constraint would have.
                self.refuse_if_taken(presentation=presentation, terms=terms)
            raise DomainError(_verification_code(failure.reason_code), failure.detail) from failure
        except ChainUnavailable as exc:
            raise DomainError(ErrorCode.VERIFICATION_UNAVAILABLE) from exc
        try:
            # A facilitator that settles it is asked too (/verify): one that refuses our
            # credentials is our outage, answered before anything is recorded.
            known.settler.verify_before_record(
                authorization=known.authorization,
                requirements=x402_requirements(terms=terms, network=known.network),
                network=known.network,
            )
        except FacilitatorRefused as exc:
            raise DomainError(ErrorCode.FACILITATOR_CREDENTIALS_REFUSED) from exc
        return head

    def record(self, *, charge: Charge) -> tuple[PaymentAttempt, Change]:
        attempt, change = x402_attempt_record(
            purchase_id=charge.purchase_id,
            authorization=charge.presentation.evidence,
            idempotency_record_id=charge.idempotency_record_id,
            fingerprint=charge.presentation.fingerprint,
            network=charge.terms.network,
            asset=charge.terms.asset,
            search_from_block=charge.search_from_block,
        )
        attempt.rail_context = charge.context  # settle, describe, resend read it from here
        return attempt, change

    def settle(
        self,
        *,
        attempt: PaymentAttempt,
        terms: QuoteTerms,
        now: datetime,
        wait_until: float | None = None,
    ) -> Settling:
        """Exactly one caller ever performs an attempt's first broadcast; others look it up.
        The broadcast's wait ends at the network's confirmation timeout or `wait_until`,
        whichever comes first (the settler's `broadcast`), and comes back as a value."""
        if not x402_attempt_claim_first_broadcast(attempt=attempt, now=now):
            return self.look_up(attempt=attempt, now=now)
        return _outcomes_marked(
            _prepare_and_broadcast(attempt, terms, now, try_claimed=False, wait_until=wait_until),
            _first_broadcast,
        )

    def look_up(self, *, attempt: PaymentAttempt, now: datetime) -> SettlementOutcome:
        context = x402_context(attempt=attempt)
        return _naming_payment_id(
            attempt,
            settlement_lookup(
                authorization=context.authorization,
                network=context.network,
                tx_hash=attempt.tx_hash,
                reader=ChainReader(context.network),
                now=int(now.timestamp()),
                logs_from_block=attempt.search_from_block or 0,
            ),
        )

    def lookup_many(
        self,
        *,
        attempts: Sequence[PaymentAttempt],
        now: datetime,
        guard: RowGuard,
        chunk_size: int | None = None,
    ) -> BatchLookup:
        """One batched chain read per network (attempts in network order): every attempt's
        tx hash and (payer, nonce) prefetched in JSON-RPC batches, then each judged by the
        same rule as `look_up`. A network that does not answer leaves its attempts
        unreachable."""
        found = BatchLookup()
        for network_id, group in groupby(attempts, key=lambda a: a.network):
            _lookup_network(
                network_config(network_id),
                list(group),
                now,
                guard,
                chunk_size or DEFAULT_CHUNK_SIZE,
                found,
            )
        return found

    def heal(self, *, now: datetime, stats: Counter[str]) -> None:
        """Close our relayers' nonce gaps (a dropped transaction, or a nonce handed out by a
        process that died before sending) so later settlements are not stalled behind them."""
        _heal_relayers(now, stats)

    def funds_watch(
        self, *, now: datetime, alert: Callable[[FundsLow], bool], stats: Counter[str]
    ) -> None:
        """Read each direct-mode relayer's gas balance, keep it (payments.rails.x402.gas) and
        alert the newly low ones."""
        relayer_gas_watch(now=now, alert=alert, stats=stats)

    def resend(
        self, *, attempt: PaymentAttempt, terms: QuoteTerms, now: datetime
    ) -> SettlementOutcome:
        """The very same signed relayer transaction again (direct), or the same payload to
        /settle (facilitator: nothing is ever signed on our side); a fresh relayer
        transaction only if none was ever signed. Never a new buyer signature."""
        # A resubmission sleeps through its wait on its own thread (a job, a command).
        if attempt.raw_transaction:
            prepared = x402_attempt_prepared(attempt=attempt)
            return waited_out(_broadcast(attempt, terms, prepared, now, try_claimed=True))
        return waited_out(_prepare_and_broadcast(attempt, terms, now, try_claimed=True))

    def never_reached(
        self, *, attempt: PaymentAttempt, outcome: SettlementOutcome, now: datetime
    ) -> bool:
        """True when resending is safe: sent before, nonce unused on chain, no broadcast of
        it known to the node, and still valid for at least the settlement margin. A known or
        pooled transaction is reconciled, never resent."""
        authorization = x402_context(attempt=attempt).authorization
        return (
            attempt.state in PENDING_ATTEMPT_STATES
            and attempt.broadcast_started_at is not None
            and outcome.status == SettlementStatus.PENDING
            and outcome.reason_code == "not_on_chain_yet"
            and not outcome.evidence.get("tx_known")
            and authorization.valid_before >= now.timestamp() + SETTLEMENT_MARGIN_SECONDS
        )

    def describe(self, *, attempt: PaymentAttempt) -> dict[str, Any]:
        """What the timeline says about how this attempt reaches the chain: the mode, and
        the authorization (payer, nonce) every submission of it carries."""
        described = {
            "mode": x402_context(attempt=attempt).network.mode,
            "payer": attempt.payer,
            "nonce": attempt.authorization_nonce,
        }
        if attempt.facilitator_payment_id:
            described[FACILITATOR_PAYMENT_ID] = attempt.facilitator_payment_id
        return described

    def held_can_land(self, *, attempt: PaymentAttempt, now: datetime) -> str:
        """The nonce unused and the payer's balance enough, on chain, and the window open
        past the settlement margin. A chain that does not answer says nothing ("")."""
        authorization = x402_context(attempt=attempt).authorization
        if authorization.valid_before < now.timestamp() + SETTLEMENT_MARGIN_SECONDS:
            return "authorization_expired"
        try:
            verify_payment_funds(
                authorization=authorization,
                reader=ChainReader(x402_context(attempt=attempt).network),
            )
        except VerificationFailed as failure:
            return failure.reason_code
        except ChainUnavailable:
            return ""
        return ""

    def refund(
        self,
        *,
        attempt: PaymentAttempt,
        buyer_id: int | None,
        reason_code: str,
        paid_by: str,
        now: datetime,
        tx_hash: str | None = None,
    ) -> tuple[Refund, list[Change]]:
        """Money on chain is owed back: finance pays it and marks the refund paid."""
        return refund_record(
            attempt=attempt, method=Refund.Method.PAY_BACK, reason_code=reason_code, tx_hash=tx_hash
        )


def x402_context(*, attempt: PaymentAttempt) -> X402Context:
    """The attempt's context: the one the request that recorded it built (kept on the
    instance), else derived from the row once and kept the same way."""
    context: X402Context | None = attempt.rail_context
    if context is None:
        context = X402Context(
            network_config(attempt.network), x402_attempt_authorization(attempt=attempt)
        )
        attempt.rail_context = context
    return context


def _context_of_presentation(presentation: Presentation, terms: QuoteTerms) -> X402Context:
    """Raises UnknownNetwork for a quote on a network we do not settle on."""
    return X402Context(network_config(terms.network), presentation.evidence)


def _lookup_network(
    network: NetworkConfig,
    attempts: list[PaymentAttempt],
    now: datetime,
    guard: RowGuard,
    chunk_size: int,
    found: BatchLookup,
) -> None:
    reader = BatchChainReader(
        network, chunk_size=chunk_size, logs_from_block=_search_from(attempts)
    )
    readable: list[PaymentAttempt] = []
    items: list[tuple[Authorization, str | None]] = []
    for attempt in attempts:
        with guard(attempt):  # stored evidence that cannot be read: that row only
            context = X402Context(network, x402_attempt_authorization(attempt=attempt))
            attempt.rail_context = context  # the follow-up (resend or not) reads it again
            items.append((context.authorization, attempt.tx_hash))
            readable.append(attempt)
    try:
        reader.prefetch(items)
    except ChainUnavailable:
        found.unreachable.extend(readable)
        return
    for attempt, (authorization, tx_hash) in zip(readable, items, strict=True):
        with guard(attempt):
            found.outcomes[attempt.pk] = _naming_payment_id(
                attempt,
                settlement_lookup(
                    authorization=authorization,
                    network=network,
                    tx_hash=tx_hash,
                    reader=reader.reader_for(authorization, tx_hash),
                    now=int(now.timestamp()),
                ),
            )
    found.round_trips += reader.round_trips
    reader.close()


def _naming_payment_id(attempt: PaymentAttempt, outcome: SettlementOutcome) -> SettlementOutcome:
    """A look-up of an attempt a facilitator took under its own payment id names that id, so
    each reconciliation step on the timeline says which of the facilitator's payments it is
    (the chain is asked by tx hash and (payer, nonce); the id is what its support knows)."""
    if not attempt.facilitator_payment_id:
        return outcome
    evidence = {**outcome.evidence, FACILITATOR_PAYMENT_ID: attempt.facilitator_payment_id}
    return replace(outcome, evidence=evidence)


def _search_from(attempts: list[PaymentAttempt]) -> int:
    """One log query covers the group: from the oldest verification block among them."""
    blocks = [a.search_from_block for a in attempts]
    return 0 if not blocks or None in blocks else min(b for b in blocks if b is not None)


def _refuse_without_gas(network: NetworkConfig) -> None:
    """Raises DomainError settlement_unavailable (Retry-After: until the next reading) when
    a direct-mode relayer is known unable to pay one settlement: its broadcast could not be
    mined, so the payment is not taken at all. Never an RPC call nor SQL: one cache read."""
    if network.mode != "direct":
        return
    known = relayer_gas_unable(network, now=timezone.now())
    if known is not None:
        logger.warning(
            "refusing a payment on %s: relayer %s holds %s wei, one settlement needs %s",
            network.caip2, known.address, known.balance, known.settle_cost,
        )  # fmt: skip
        raise DomainError(
            ErrorCode.SETTLEMENT_UNAVAILABLE,
            retry_after=max(1, math.ceil(settings.X402_RELAYER_GAS_EVERY_SECONDS)),
        )


def _heal_relayers(now: datetime, stats: Counter[str]) -> None:
    from payments.rails.x402.chain import w3_for
    from payments.rails.x402.direct import relayer_signer_for
    from payments.rails.x402.relayer import relayer_heal

    for network_id in relayer_networks():
        network = network_config(network_id)
        account = relayer_signer_for(network)
        known = list(
            PaymentAttempt.objects.filter(
                network=network_id,
                state__in=PENDING_ATTEMPT_STATES,
                relayer_nonce__isnull=False,
                relayer_address__in=(account.address, ""),
            )
            .exclude(raw_transaction="")
            .values_list("relayer_nonce", "raw_transaction")
        )
        try:
            actions = relayer_heal(
                network=network,
                w3=w3_for(network),
                account=account,
                known=known,
                now=now,
            )
        except Exception:  # an unreachable node: the next run tries again
            logger.exception("relayer heal on %s failed", network_id)
            stats[f"{network_id}:unreachable"] += 1
            continue
        for action in actions:
            stats[f"{network_id}:{action['action']}"] += 1


def _first_broadcast(outcome: SettlementOutcome) -> SettlementOutcome:
    return replace(outcome, evidence={**outcome.evidence, FIRST_BROADCAST: True})


def _outcomes_marked(
    sent: Settling, mark: Callable[[SettlementOutcome], SettlementOutcome]
) -> Settling:
    """`mark` on the outcome, or on every outcome its wait gives."""
    return sent.map(mark) if isinstance(sent, Awaiting) else mark(sent)


def _prepare_and_broadcast(
    attempt: PaymentAttempt,
    terms: QuoteTerms,
    now: datetime,
    *,
    try_claimed: bool,
    wait_until: float | None = None,
) -> Settling:
    context = x402_context(attempt=attempt)
    try:
        prepared = context.settler.prepare(
            authorization=context.authorization, network=context.network
        )
    except BroadcastNotPrepared as exc:
        # Nothing was signed or sent: pending, and the next look-up tries again.
        return SettlementOutcome(
            SettlementStatus.PENDING, None, "broadcast_not_prepared", evidence={"detail": str(exc)}
        )
    x402_attempt_mark_prepared(attempt=attempt, prepared=prepared, now=now)
    return _broadcast(attempt, terms, prepared, now, try_claimed=try_claimed, wait_until=wait_until)


def _broadcast(
    attempt: PaymentAttempt,
    terms: QuoteTerms,
    prepared: PreparedBroadcast,
    now: datetime,
    *,
    try_claimed: bool,
    wait_until: float | None = None,
) -> Settling:
    """Send `prepared`; if another transaction took its relayer nonce meanwhile, the same
    authorization once more on a fresh nonce (`_on_a_fresh_nonce`). `try_claimed`: the
    caller counted this send as a resubmission already (`resubmit`)."""
    outcome = _send(attempt, terms, prepared, wait_until)
    if isinstance(outcome, Awaiting) or outcome.reason_code != RELAYER_NONCE_TAKEN:
        return outcome  # a wait is a send that was taken
    return _on_a_fresh_nonce(
        attempt, terms, prepared, outcome, now, try_claimed=try_claimed, wait_until=wait_until
    )


def _send(
    attempt: PaymentAttempt,
    terms: QuoteTerms,
    prepared: PreparedBroadcast,
    wait_until: float | None,
) -> Settling:
    context = x402_context(attempt=attempt)
    return context.settler.broadcast(
        authorization=context.authorization,
        requirements=x402_requirements(terms=terms, network=context.network),
        network=context.network,
        prepared=prepared,
        wait_until=wait_until,
    )


def _on_a_fresh_nonce(
    attempt: PaymentAttempt,
    terms: QuoteTerms,
    taken: PreparedBroadcast,
    refused: SettlementOutcome,
    now: datetime,
    *,
    try_claimed: bool,
    wait_until: float | None = None,
) -> Settling:
    """Our signed relayer transaction was refused because another one took its nonce: a
    holder slow past its nonce's lease, whose gap the next broadcaster closed. It can never
    be mined, and the buyer's authorization was never broadcast. While that authorization
    is unused and its window open (the settlement margin), sign it into a new relayer
    transaction on a fresh nonce lease, commit it on the attempt in place of the refused
    one (counted as a resubmission, claimed before the nonce is allocated: one caller
    only), then send it. The refused hash can never land, so only one transaction of it is
    ever live; both are on the timeline. Otherwise `refused` (pending) is the answer, and
    the look-ups judge the authorization as for any other settlement."""
    context = x402_context(attempt=attempt)
    evidence = refused.evidence
    closes = max(now.timestamp(), evidence.get("head_timestamp") or 0) + SETTLEMENT_MARGIN_SECONDS
    if evidence.get("authorization_used") or context.authorization.valid_before < closes:
        return refused
    if not try_claimed:
        if attempt.resubmissions >= settings.TOLLBOOTH["SETTLEMENT_RESUBMIT_LIMIT"]:
            return refused  # the look-ups refuse it at the limit and escalate to support
        if not x402_attempt_claim_resubmission(
            attempt=attempt, replacing_tx_hash=taken.tx_hash or "", now=now
        ):
            return refused  # another caller is sending this attempt now
    try:
        fresh = context.settler.prepare(
            authorization=context.authorization, network=context.network
        )
    except BroadcastNotPrepared as exc:
        return replace(refused, evidence={**evidence, "detail": str(exc)})
    if not x402_attempt_replace_prepared(
        attempt=attempt, replacing_tx_hash=taken.tx_hash or "", prepared=fresh, now=now
    ):
        # Moved since the claim: nothing sent; the fresh nonce is closed once its lease lapses.
        return refused
    replaced = {
        "try": attempt.resubmissions,
        "reason_code": RELAYER_NONCE_TAKEN,
        "replaced_tx_hash": taken.tx_hash,
        "replaced_relayer_nonce": taken.relayer_nonce,
        "tx_hash": fresh.tx_hash,
        "relayer_nonce": fresh.relayer_nonce,
        "refusal": evidence.get("error", ""),
    }
    logger.warning(
        "attempt %s: relayer nonce %s was taken; sent again as %s at nonce %s",
        attempt.pk, taken.relayer_nonce, fresh.tx_hash, fresh.relayer_nonce,
    )  # fmt: skip

    def told(outcome: SettlementOutcome) -> SettlementOutcome:
        return replace(outcome, evidence={**outcome.evidence, REPLACED_SUBMISSION: replaced})

    return _outcomes_marked(_send(attempt, terms, fresh, wait_until), told)


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
