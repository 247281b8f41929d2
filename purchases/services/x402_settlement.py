"""Settling an x402 attempt and answering from the purchase's current state.

An attempt whose broadcast may already have happened is looked up on chain (by tx hash
and by payer + nonce) before anything is sent again; what is sent again is only ever the
same signed authorization (in direct mode the exact transaction committed before the first
broadcast), and only as `x402_resubmit` allows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

from django.conf import settings
from django.db import DatabaseError, transaction

from core.actors import Actor
from core.bulk import bulk_update_columns
from core.clock import now_or
from core.errors import PROBLEM_HEADERS, DomainError, ErrorCode
from payments.models import PaymentAttempt, Rail
from payments.x402.attempts import (
    OUTCOME_FIELDS,
    x402_attempt_apply_outcome,
    x402_attempt_authorization,
    x402_attempt_live,
    x402_attempt_mark_prepared,
    x402_attempt_prepared,
)
from payments.x402.chain import ChainReader
from payments.x402.direct import BroadcastNotPrepared
from payments.x402.lookup import settlement_lookup
from payments.x402.networks import network_config
from payments.x402.settlers import settler_for
from payments.x402.types import (
    Authorization,
    NetworkConfig,
    PreparedBroadcast,
    Requirements,
    SettlementOutcome,
    SettlementStatus,
)
from payments.x402.wire import payment_response_header
from purchases.events import (
    event_record_change,
    events_batched,
    events_of_one_row,
    purchase_transition,
)
from purchases.models import Offering, Purchase, Quote
from purchases.selectors import (
    purchase_capability_url,
    purchase_get_by_capability,
    purchase_status,
)
from purchases.services.delivery import DeliveryPending, purchase_result_deliver
from purchases.services.late_payments import settlement_unexpected
from purchases.services.sweeper import purchase_execution_stage, purchase_executions_stage
from purchases.services.x402_resubmit import x402_resubmit_if_due

logger = logging.getLogger(__name__)
PAY = Purchase.PaymentState
RUN = Purchase.FulfillmentState


@dataclass(frozen=True)
class X402Answer:
    status: int
    body: Any  # a JSON document, or the result's bytes
    headers: dict[str, str]
    content_type: str | None = None


def _seller_terms(offering: Offering) -> tuple[tuple[str, int | str], ...]:
    # Stated in the 402 so an agent can tell a re-signed retry will not be charged again.
    return (("duplicateWindowSeconds", int(offering.duplicate_window.total_seconds())),)


def x402_requirements(*, quote: Quote, network: NetworkConfig) -> Requirements:
    """What we asked for: the `accepts` entry a quote stands for on its network."""
    return Requirements(
        network=quote.network,
        asset=quote.asset,
        amount=quote.price,
        pay_to=quote.pay_to,
        max_timeout_seconds=network.max_timeout_seconds,
        quote_id=quote.public_id,
        terms=_seller_terms(quote.offering),
    )


def x402_requirements_for_offering(*, offering: Offering, network: NetworkConfig) -> Requirements:
    """The price-only `accepts` entry (no quote): for discovery and input-less offers."""
    return Requirements(
        network=offering.network,
        asset=offering.asset,
        amount=offering.price,
        pay_to=offering.pay_to,
        max_timeout_seconds=network.max_timeout_seconds,
        quote_id=None,
        terms=_seller_terms(offering),
    )


def x402_settle_attempt(
    *, attempt_id: int, now: datetime | None = None
) -> SettlementOutcome | None:
    """Broadcast a recorded attempt, or resume one whose broadcast may have happened.

    Network I/O happens here with no transaction open; the outcome is recorded after.
    """
    now = now_or(now)
    attempt = PaymentAttempt.objects.select_related("purchase__quote").get(pk=attempt_id)
    if attempt.state in (PaymentAttempt.State.SUCCEEDED, PaymentAttempt.State.FAILED):
        return None
    network = network_config(attempt.network)
    authorization = x402_attempt_authorization(attempt=attempt)
    if _claim_first_broadcast(attempt.pk, now):
        outcome = _prepare_and_broadcast(attempt, authorization, network, now)
    else:
        outcome = _lookup(authorization, network, attempt.tx_hash, now, attempt.search_from_block)
    outcome = x402_follow_up(
        attempt=attempt, authorization=authorization, network=network, outcome=outcome, now=now
    )
    x402_record_outcome(
        attempt_id=attempt.pk, purchase_id=attempt.purchase_id, outcome=outcome, now=now
    )
    return outcome


def x402_follow_up(
    *,
    attempt: PaymentAttempt,
    authorization: Authorization,
    network: NetworkConfig,
    outcome: SettlementOutcome,
    now: datetime,
    actor: Actor | None = None,
) -> SettlementOutcome:
    """Act on what a look-up found before recording it: submit the same signed authorization
    again if it never reached the chain (bounded, see x402_resubmit), and never believe a
    revert until the nonce has been looked up."""
    outcome = x402_resubmit_if_due(
        attempt=attempt,
        authorization=authorization,
        network=network,
        outcome=outcome,
        now=now,
        send=partial(_resend, authorization=authorization, network=network, now=now),
        actor=actor or Actor.system("settlement"),
    )
    if outcome.status == SettlementStatus.FAILED and outcome.reason_code == "transaction_reverted":
        outcome = _lookup(
            authorization,
            network,
            outcome.tx_hash or attempt.tx_hash,
            now,
            attempt.search_from_block,
        )
    return outcome


def _resend(
    attempt: PaymentAttempt, *, authorization: Authorization, network: NetworkConfig, now: datetime
) -> SettlementOutcome:
    # The very same signed relayer transaction again (direct), or the same payload to /settle
    # (facilitator: nothing is ever signed on our side); a fresh relayer transaction only if
    # none was ever signed. Never a new buyer signature.
    if attempt.raw_transaction:
        return _broadcast(attempt, authorization, network, x402_attempt_prepared(attempt=attempt))
    return _prepare_and_broadcast(attempt, authorization, network, now)


def _claim_first_broadcast(attempt_id: int, now: datetime) -> bool:
    """Exactly one caller ever performs an attempt's first broadcast; others look it up."""
    return bool(
        PaymentAttempt.objects.filter(pk=attempt_id, broadcast_started_at__isnull=True).update(
            broadcast_started_at=now
        )
    )


def _prepare_and_broadcast(
    attempt: PaymentAttempt, authorization: Authorization, network: NetworkConfig, now: datetime
) -> SettlementOutcome:
    settler = settler_for(network)
    try:
        prepared = settler.prepare(authorization=authorization, network=network)
    except BroadcastNotPrepared as exc:
        # Nothing was signed or sent: pending, and the next look-up tries again.
        return SettlementOutcome(
            SettlementStatus.PENDING, None, "broadcast_not_prepared", evidence={"detail": str(exc)}
        )
    x402_attempt_mark_prepared(attempt_id=attempt.pk, prepared=prepared, now=now)
    return _broadcast(attempt, authorization, network, prepared)


def _broadcast(
    attempt: PaymentAttempt,
    authorization: Authorization,
    network: NetworkConfig,
    prepared: PreparedBroadcast,
) -> SettlementOutcome:
    return settler_for(network).broadcast(
        authorization=authorization,
        requirements=x402_requirements(quote=attempt.purchase.quote, network=network),
        network=network,
        prepared=prepared,
    )


def _lookup(
    authorization: Authorization,
    network: NetworkConfig,
    tx_hash: str | None,
    now: datetime,
    from_block: int | None,
) -> SettlementOutcome:
    return settlement_lookup(
        authorization=authorization,
        network=network,
        tx_hash=tx_hash,
        reader=ChainReader(network),
        now=int(now.timestamp()),
        logs_from_block=from_block or 0,
    )


def x402_record_outcome(
    *, attempt_id: int, purchase_id: int, outcome: SettlementOutcome, now: datetime
) -> None:
    """Lock purchase then attempt, apply the chain's answer to both, queue the work if due."""
    actor = Actor.system("settlement")
    with transaction.atomic(), events_batched():
        purchase = (
            Purchase.objects.select_for_update(of=("self",))
            .select_related("offering")
            .get(pk=purchase_id)
        )
        attempt = PaymentAttempt.objects.select_for_update().get(pk=attempt_id)
        attempt.purchase = purchase
        if (
            attempt.state == PaymentAttempt.State.FAILED
            and outcome.status == SettlementStatus.CONFIRMED
        ):
            # We had recorded this authorization as failed, yet its transfer landed.
            settlement_unexpected(
                purchase=purchase,
                attempt=attempt,
                tx_hash=outcome.tx_hash or "",
                now=now,
                actor=actor,
            )
            purchase_queue_execution_if_due(purchase=purchase, actor=actor)
            return
        change = x402_attempt_apply_outcome(attempt=attempt, outcome=outcome)
        event_record_change(purchase=purchase, actor=actor, change=change)
        if change is None or change.from_state == change.to_state:
            return
        move = _payment_move(purchase, outcome, now)
        if move is not None:
            transition, arguments = move
            purchase_transition(
                purchase=purchase,
                transition=transition,
                actor=actor,
                arguments=arguments,
                update_fields=["paid_at", "reason_code"],
                evidence={"tx_hash": attempt.tx_hash, "network": attempt.network},
            )
        purchase_queue_execution_if_due(purchase=purchase, actor=actor)


# One transaction per this many rows: its locks and statements, not one per row.
RECORD_CHUNK = 500
_PURCHASE_FIELDS = ("payment_state", "fulfillment_state", "paid_at", "reason_code", "updated_at")


@dataclass(frozen=True)
class SettlementToRecord:
    attempt_id: int
    purchase_id: int
    outcome: SettlementOutcome


def x402_record_outcomes(
    *, rows: list[SettlementToRecord], now: datetime
) -> list[SettlementToRecord]:
    """`x402_record_outcome` for many rows, in statements per chunk rather than per row.

    Each chunk is one transaction: lock its purchases, then its attempts (parent before
    child, by pk), apply every outcome in memory with the same transitions, then write the
    attempts, the purchases, the timeline and the staged executions in a few statements.
    Returns the rows left for the one-row path: a row whose processing raised, an outcome
    the one-row path handles itself (money landing on an attempt recorded as failed), and
    every row of a chunk whose writes the database refused (then nothing of it is written).
    """
    left: list[SettlementToRecord] = []
    for start in range(0, len(rows), RECORD_CHUNK):
        chunk = rows[start : start + RECORD_CHUNK]
        try:
            left += _record_chunk(chunk, now)
        except DatabaseError:
            logger.exception("bulk recording of %d settlements refused; one by one", len(chunk))
            left += chunk
    return left


def _record_chunk(chunk: list[SettlementToRecord], now: datetime) -> list[SettlementToRecord]:
    actor = Actor.system("settlement")
    left: list[SettlementToRecord] = []
    with transaction.atomic(), events_batched():
        purchases = {
            p.pk: p
            for p in Purchase.objects.select_for_update(of=("self",))
            .select_related("offering")
            .filter(pk__in=[row.purchase_id for row in chunk])
            .order_by("pk")
        }
        attempts = {
            a.pk: a
            for a in PaymentAttempt.objects.select_for_update()
            .filter(pk__in=[row.attempt_id for row in chunk])
            .order_by("pk")
        }
        moved_attempts: dict[int, PaymentAttempt] = {}
        moved_purchases: dict[int, Purchase] = {}
        seen_purchases: set[int] = set()
        to_execute: list[int] = []
        for row in chunk:
            attempt, purchase = attempts.get(row.attempt_id), purchases.get(row.purchase_id)
            if attempt is None or purchase is None or attempt.purchase_id != purchase.pk:
                left.append(row)
                continue
            if purchase.pk in seen_purchases or (
                attempt.state == PaymentAttempt.State.FAILED
                and row.outcome.status == SettlementStatus.CONFIRMED
            ):
                left.append(row)  # a second attempt of one purchase, or late money: one by one
                continue
            seen_purchases.add(purchase.pk)
            try:
                with events_of_one_row():
                    attempt.purchase = purchase
                    change = x402_attempt_apply_outcome(
                        attempt=attempt, outcome=row.outcome, save=False
                    )
                    event_record_change(purchase=purchase, actor=actor, change=change)
                    queued = False
                    if change is not None and change.from_state != change.to_state:
                        move = _payment_move(purchase, row.outcome, now)
                        if move is not None:
                            transition, arguments = move
                            purchase_transition(
                                purchase=purchase,
                                transition=transition,
                                actor=actor,
                                arguments=arguments,
                                evidence={"tx_hash": attempt.tx_hash, "network": attempt.network},
                                save=False,
                            )
                        queued = _queue_if_due(purchase, actor)
            except Exception:
                logger.exception("settlement of attempt %s left to the one-row path", attempt.pk)
                # Its in-memory changes are dropped with it: the one-row path reloads both.
                left.append(row)
                continue
            if change is not None:
                attempt.updated_at = now_or(None)
                moved_attempts[attempt.pk] = attempt
                if change.from_state != change.to_state:
                    purchase.updated_at = attempt.updated_at
                    moved_purchases[purchase.pk] = purchase
                if queued:
                    to_execute.append(purchase.pk)
        bulk_update_columns(moved_attempts.values(), [*OUTCOME_FIELDS, "updated_at"])
        bulk_update_columns(moved_purchases.values(), _PURCHASE_FIELDS)
        purchase_executions_stage(purchase_ids=to_execute, now=now)
    return left


def _queue_if_due(purchase: Purchase, actor: Actor) -> bool:
    """`purchase_queue_execution_if_due` without the writes; True when it queued."""
    if (
        purchase.fulfillment_state != RUN.NOT_STARTED
        or not purchase.is_payment_sufficient_for_execution()
    ):
        return False
    purchase_transition(
        purchase=purchase, transition=purchase.fulfillment_queue, actor=actor, save=False
    )
    return True


def _payment_move(
    purchase: Purchase, outcome: SettlementOutcome, now: datetime
) -> tuple[Callable[..., None], dict[str, Any]] | None:
    """The purchase's payment transition for what the chain said, if any."""
    if outcome.status == SettlementStatus.CONFIRMED:
        return purchase.payment_complete, {"paid_at": now}
    if outcome.status == SettlementStatus.FAILED:
        return purchase.payment_fail, {"reason_code": outcome.reason_code}
    if purchase.payment_state == PAY.PAYING:
        return purchase.payment_pend, {"reason_code": outcome.reason_code or "settlement_pending"}
    return None


def purchase_queue_execution_if_due(*, purchase: Purchase, actor: Actor) -> None:
    """Queue the paid work once the offering's payment condition holds. Caller holds the lock."""
    if (
        purchase.fulfillment_state != RUN.NOT_STARTED
        or not purchase.is_payment_sufficient_for_execution()
    ):
        return
    purchase_transition(purchase=purchase, transition=purchase.fulfillment_queue, actor=actor)
    purchase_execution_stage(purchase_id=purchase.pk)


def purchase_reload(*, purchase: Purchase) -> Purchase:
    # A fresh instance, not refresh_from_db(): django-fsm's refresh toggles `protected` on
    # the shared field object, which is not safe with threads serving requests.
    return Purchase.objects.select_related("offering", "quote").get(pk=purchase.pk)


def x402_answer_for_purchase(*, purchase: Purchase, reconcile: bool) -> X402Answer:
    """What an x402 client gets for this purchase now: the result, pending, or the failure."""
    if reconcile and purchase.payment_state in (PAY.PAYING, PAY.SETTLEMENT_PENDING):
        attempt = x402_attempt_live(purchase_id=purchase.pk)
        if attempt is not None:
            x402_settle_attempt(attempt_id=attempt.pk)
        purchase = purchase_reload(purchase=purchase)
    attempt = purchase.payment_attempts.order_by("-pk").first()
    if purchase.payment_state == PAY.FAILED:
        error = DomainError(
            ErrorCode.PAYMENT_FAILED,
            purchase=purchase.ref,
            extra={"reason": attempt.reason_code if attempt else purchase.reason_code},
        )
        return X402Answer(error.spec.status, error.as_problem(), dict(PROBLEM_HEADERS))
    if not purchase.is_payment_sufficient_for_execution():
        return _pending_answer(purchase, attempt)
    return _delivery_answer(purchase, attempt)


def _payment_response(purchase: Purchase, attempt: PaymentAttempt | None) -> str:
    is_settled = purchase.payment_state == PAY.PAID
    return payment_response_header(
        success=is_settled,
        transaction=attempt.tx_hash if attempt else None,
        network=purchase.network,
        payer=purchase.payer,
        error_reason=None if is_settled else "settlement_pending",
        amount=purchase.amount,
    )


def _retry_after() -> dict[str, str]:
    return {"Retry-After": str(settings.TOLLBOOTH["RETRY_AFTER_SECONDS"])}


def _pending_answer(purchase: Purchase, attempt: PaymentAttempt | None) -> X402Answer:
    status_url = purchase_capability_url(purchase=purchase)
    body = {
        **purchase_status(purchase=purchase, now=now_or(None)),
        "status": "settlement_pending",
        "transaction": attempt.tx_hash if attempt else None,
        # x402 agents may have no API key: the status URL, or resending the same signed
        # payment, is how they poll.
        "next_action": "poll_status_url",
        "owner": "reconciliation",
        "reason_code": (attempt.reason_code if attempt else "") or purchase.reason_code or None,
        "status_url": status_url,
    }
    headers = {
        "PAYMENT-RESPONSE": _payment_response(purchase, attempt),
        "Location": status_url,
        **_retry_after(),
    }
    return X402Answer(202, body, headers)


def _await_work(purchase: Purchase) -> Purchase:
    """Give a fast job the chance to answer in this round trip: up to the offering's expected
    run time, never past the server-wide cap; then 202."""
    wait = min(
        purchase.offering.expected_run_time.total_seconds(),
        float(settings.X402_RESULT_WAIT_SECONDS),
    )
    deadline = time.monotonic() + wait
    state = purchase.fulfillment_state
    while state in (RUN.QUEUED, RUN.RUNNING) and time.monotonic() < deadline:
        time.sleep(0.1)
        state = Purchase.objects.values_list("fulfillment_state", flat=True).get(pk=purchase.pk)
    return purchase if state == purchase.fulfillment_state else purchase_reload(purchase=purchase)


def _delivery_answer(purchase: Purchase, attempt: PaymentAttempt | None) -> X402Answer:
    purchase = _await_work(purchase)
    headers = {"PAYMENT-RESPONSE": _payment_response(purchase, attempt)}
    try:
        delivery = purchase_result_deliver(purchase=purchase)
    except DeliveryPending as pending:
        status_url = purchase_capability_url(purchase=purchase)
        body = {**pending.status, "next_action": "poll_status_url", "status_url": status_url}
        return X402Answer(202, body, {**headers, "Location": status_url, **_retry_after()})
    except DomainError as error:
        return X402Answer(
            error.spec.status,
            error.as_problem(),
            {**headers, **PROBLEM_HEADERS},
        )
    headers.update(
        {
            "Repr-Digest": f"sha-256=:{delivery.sha256_b64}:",
            "Link": f'<{delivery.receipt_url}>; rel="receipt"',
        }
    )
    return X402Answer(200, delivery.body, headers, content_type=delivery.content_type)


def x402_answer_for_capability(*, ref: str, token: str) -> X402Answer:
    """What the capability URL shows: this purchase's status, or its result once ready.

    Reconciles a pending settlement first, exactly as a resent payment would.
    Raises DomainError: purchase_not_found (wrong token, another purchase's, or no purchase).
    """
    purchase = purchase_get_by_capability(ref=ref, token=token)
    answer = x402_answer_for_purchase(purchase=purchase, reconcile=True)
    if purchase.rail != Rail.X402:
        answer.headers.pop("PAYMENT-RESPONSE", None)
    return answer
