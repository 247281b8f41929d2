"""Reads for the agent API and the admin: each boundary's state and whose move is next."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist
from django.db.models import (
    Count,
    DateTimeField,
    DurationField,
    ExpressionWrapper,
    Q,
    QuerySet,
    Sum,
    Value,
)
from django.db.models.functions import Lower, TruncDate
from django.db.models.lookups import GreaterThan
from django.urls import reverse
from django.utils import timezone
from django.utils.crypto import constant_time_compare, salted_hmac

from core.clock import now_or
from core.errors import DomainError, ErrorCode
from core.prepared import PreparedQuery
from core.refs import payment_id_hash
from fulfillment import selectors as fulfillment_selectors
from fulfillment.models import ExecutionAttempt, Receipt, Result
from payments import selectors as payment_selectors
from payments.models import PENDING_ATTEMPT_STATES, PaymentAttempt, Rail, Refund
from payments.rails.x402.networks import UnknownNetwork, network_config
from purchases.case_checks import HEAL_EVERY
from purchases.case_facts import (
    CaseFacts,
    EscalationFact,
    ExecutionFact,
    RefundFact,
    RelayerGapFact,
    UnfinalFact,
)
from purchases.case_file import DUPLICATE, LATE
from purchases.event_subjects import EXECUTION_RETRIED, OFFERING_UPSTREAM_CHANGED
from purchases.models import (
    Buyer,
    Escalation,
    IdempotencyRecord,
    Offering,
    Purchase,
    PurchaseEvent,
    Quote,
)

PAY = Purchase.PaymentState
RUN = Purchase.FulfillmentState


def offerings_for_sale() -> list[Offering]:
    """The active offerings, by slug: what the offerings list shows a buyer."""
    return list(Offering.objects.filter(is_active=True).order_by("slug"))


def offering_upstream_changes(*, slug: str, limit: int = 20) -> list[PurchaseEvent]:
    """The offering's upstream changes, newest first: who, when, what (no secrets)."""
    events = PurchaseEvent.objects.filter(
        subject=OFFERING_UPSTREAM_CHANGED, purchase=None, evidence__offering=slug
    )
    return list(events.order_by("-created_at", "-pk")[:limit])


def purchase_get_for_buyer(*, buyer: Buyer, ref: str, with_result: bool = False) -> Purchase:
    """Another buyer's purchase is indistinguishable from a missing one. `with_result`: its
    result and receipt come in the same query (for a delivery).

    Raises DomainError: purchase_not_found.
    """
    related = ("quote", "offering", "result", "receipt") if with_result else ("quote", "offering")
    purchase = Purchase.objects.select_related(*related).filter(ref=ref, buyer=buyer).first()
    if purchase is None:
        raise DomainError(ErrorCode.PURCHASE_NOT_FOUND)
    return purchase


def purchase_capability_token(*, ref: str) -> str:
    """An unguessable token tied to one purchase: HMAC of its ref under the secret key.

    Derived, not stored, so every answer about the purchase can hand out the same URL.
    """
    return salted_hmac("tollbooth.purchase-capability", ref, algorithm="sha256").hexdigest()


def purchase_capability_url(*, purchase: Purchase) -> str:
    """Where a buyer without an API key polls this purchase and fetches its result."""
    return reverse(
        "x402-purchase-capability",
        kwargs={"ref": purchase.ref, "token": purchase_capability_token(ref=purchase.ref)},
    )


def purchase_get_by_capability(*, ref: str, token: str) -> Purchase:
    """A wrong token, or another purchase's, is indistinguishable from a missing purchase.

    Raises DomainError: purchase_not_found.
    """
    if not constant_time_compare(token, purchase_capability_token(ref=ref)):
        raise DomainError(ErrorCode.PURCHASE_NOT_FOUND)
    purchase = Purchase.objects.select_related("quote", "offering").filter(ref=ref).first()
    if purchase is None:
        raise DomainError(ErrorCode.PURCHASE_NOT_FOUND)
    return purchase


def quote_get_for_buyer(*, buyer: Buyer, public_id: str) -> Quote:
    quote = (
        Quote.objects.select_related("offering").filter(public_id=public_id, buyer=buyer).first()
    )
    if quote is None:
        raise DomainError(ErrorCode.QUOTE_NOT_FOUND)
    return quote


# Work whose outcome is unknown is still pending to the buyer: it is checked again until the
# executor says for sure (purchases.services.fulfil.execution_recheck). Unknown is never "failed".
PENDING_RUN_STATES = (RUN.NOT_STARTED, RUN.QUEUED, RUN.RUNNING, RUN.UNKNOWN)


def _execution(purchase: Purchase, now: datetime) -> dict[str, Any]:
    if purchase.fulfillment_state != RUN.UNKNOWN:
        return {"state": purchase.fulfillment_state}
    next_check = fulfillment_selectors.execution_next_check_at(purchase_id=purchase.pk)
    return {
        "state": purchase.fulfillment_state,
        # What is awaited: the executor's word on the job, asked again automatically.
        "awaiting": "executor",
        "next_check_at": next_check.isoformat() if next_check else None,
    }


def pending_retry_after(*, status: dict[str, Any], now: datetime) -> int:
    """Seconds a buyer should wait before polling a pending purchase again: the usual short
    wait, or up to the next check of work whose outcome is unknown (at most 5 minutes)."""
    short = int(settings.TOLLBOOTH["RETRY_AFTER_SECONDS"])
    next_check = (status.get("execution") or {}).get("next_check_at")
    if not next_check:
        return short
    until = (datetime.fromisoformat(next_check) - now).total_seconds()
    return int(min(max(until, short), 300))


def _delivery_state(purchase: Purchase, now: datetime) -> str:
    result = fulfillment_selectors.result_for_purchase(purchase_id=purchase.pk)
    if result is None:
        return "pending" if purchase.fulfillment_state in PENDING_RUN_STATES else "none"
    if fulfillment_selectors.result_is_expired(result=result, now=now):
        return "expired"
    return "delivered" if result.first_delivered_at else "available"


def _remedy(purchase: Purchase) -> dict[str, Any]:
    # A staff proposal is nothing to the buyer until finance approves it.
    refunds = [
        r
        for r in payment_selectors.refunds_for_purchase(purchase_id=purchase.pk)
        if r.state in (Refund.State.OWED, Refund.State.PAID)
    ]
    escalations = list(purchase.escalations.order_by("pk"))
    open_escalations = [e for e in escalations if e.state == Escalation.State.OPEN]
    if open_escalations:
        state = "escalated"
    elif any(r.state == Refund.State.OWED for r in refunds):
        state = "refund_owed"
    elif refunds:
        state = "refunded"
    else:
        state = "none"
    return {
        "state": state,
        "refunds": [
            {
                "amount": str(r.amount),
                "asset": r.asset,
                "method": r.method,
                "state": r.state,
                "reason_code": r.reason_code,
            }
            for r in refunds
        ],
        "escalations": [
            {
                "owner": e.owner,
                "reason_code": e.reason_code,
                "state": e.state,
                "deadline_at": e.deadline_at.isoformat(),
            }
            for e in escalations
        ],
    }


def _next_move(purchase: Purchase, delivery: str, remedy: str) -> tuple[str, str]:
    """(next_action, owner): what should happen next and who has to do it."""
    if purchase.fulfillment_state == RUN.UNKNOWN and purchase.payment_state == PAY.PAID:
        # Support is told (an escalation), but the buyer's move is to poll: checked again.
        return "poll_result", "system"
    if remedy == "escalated":
        return "wait_for_support", "support"
    if purchase.payment_state in (PAY.UNPAID, PAY.FAILED):
        return "new_payment", "buyer"
    if purchase.payment_state == PAY.REVERSED:
        return "contact_seller", "support"
    if purchase.payment_state in (PAY.PAYING, PAY.SETTLEMENT_PENDING):
        return "poll_purchase", "reconciliation"
    if purchase.fulfillment_state in (RUN.NOT_STARTED, RUN.QUEUED, RUN.RUNNING):
        return "poll_result", "system"
    if purchase.fulfillment_state == RUN.SUCCEEDED:
        return ("use_receipt", "none") if delivery == "expired" else ("fetch_result", "buyer")
    if remedy == "refund_owed":
        return "wait_for_refund", "finance"
    return "none", "none"


def _settlement(purchase: Purchase, attempt: PaymentAttempt | None) -> dict[str, Any]:
    if attempt is None:
        return {"state": "none", "network": None, "transaction": None}
    return {
        "state": attempt.state,
        "network": attempt.network,
        "transaction": attempt.tx_hash or attempt.settlement_reference or None,
        # Settled, and past the network's finality policy: no reorg can undo it any more
        # (a ledger debit is final when made).
        "final": attempt.state == PaymentAttempt.State.SUCCEEDED
        and (attempt.rail != Rail.X402 or attempt.final_at is not None),
    }


def purchase_status(
    *, purchase: Purchase, now: datetime, created_with: PaymentAttempt | None = None
) -> dict[str, Any]:
    """The purchase as an agent sees it: every boundary, the reason, the next move.

    `created_with`: the purchase was created in this transaction with this payment, so it
    has no result, refund, escalation or receipt yet: nothing else is read.
    """
    quote = purchase.quote
    if created_with is not None:
        delivery, receipt = "pending", None
        remedy: dict[str, Any] = {"state": "none", "refunds": [], "escalations": []}
        attempt: PaymentAttempt | None = created_with
    else:
        delivery = _delivery_state(purchase, now)
        remedy = _remedy(purchase)
        receipt = fulfillment_selectors.receipt_for_purchase(purchase_id=purchase.pk)
        attempt = payment_selectors.payment_attempt_latest(purchase_id=purchase.pk)
    next_action, owner = _next_move(purchase, delivery, remedy["state"])
    return {
        "purchase": purchase.ref,
        "offering": purchase.offering.slug,
        "amount": str(purchase.amount),
        "asset": purchase.asset,
        "network": purchase.network,
        "rail": purchase.rail,
        "channel": purchase.channel,
        "quote": {
            "id": quote.public_id,
            "state": quote.state,
            "version": quote.offering_version,
            "expires_at": quote.expires_at.isoformat(),
        },
        "payment": {
            "state": purchase.payment_state,
            "paid_at": purchase.paid_at.isoformat() if purchase.paid_at else None,
        },
        "settlement": _settlement(purchase, attempt),
        "execution": _execution(purchase, now),
        "delivery": {"state": delivery},
        "remedy": remedy,
        "reason_code": purchase.reason_code or None,
        "next_action": next_action,
        "owner": owner,
        "links": {
            "self": reverse("api:purchase-detail", kwargs={"ref": purchase.ref}),
            "result": reverse("api:purchase-result", kwargs={"ref": purchase.ref}),
            "receipt": reverse("api:receipt-detail", kwargs={"public_id": receipt.public_id})
            if receipt
            else None,
        },
    }


def quote_representation(*, quote: Quote) -> dict[str, Any]:
    return {
        "id": quote.public_id,
        "offering": quote.offering.slug,
        "price": str(quote.price),
        "asset": quote.asset,
        "network": quote.network,
        "pay_to": quote.pay_to,
        "version": quote.offering_version,
        "input_hash": quote.input_hash,
        "holds_stock": quote.holds_stock,
        "state": quote.state,
        "expires_at": quote.expires_at.isoformat(),
        "links": {"purchase": reverse("api:quote-purchase", kwargs={"public_id": quote.public_id})},
    }


@dataclass(frozen=True)
class CaseRecords:
    """Every row the case file shows about one purchase, each table read once: the purchase
    page (Now box, strip, inlines) reads nothing per row. An attempt's refunds are already
    on it (`attempt.refunds.all()` reads no row), taken from the purchase's refunds."""

    attempts: tuple[PaymentAttempt, ...]
    executions: tuple[ExecutionAttempt, ...]
    refunds: tuple[Refund, ...]
    escalations: tuple[Escalation, ...]
    result: Result | None
    receipt: Receipt | None


def _related_one(purchase: Purchase, name: str) -> Any:
    """The purchase's result or receipt: from its select_related join when it was made
    (None when the join found nothing), else read."""
    descriptor = getattr(Purchase, name)
    if not descriptor.is_cached(purchase):
        getter = {
            "result": fulfillment_selectors.result_for_purchase,
            "receipt": fulfillment_selectors.receipt_for_purchase,
        }[name]
        return getter(purchase_id=purchase.pk)
    try:
        return getattr(purchase, name)
    except ObjectDoesNotExist:
        return None


def purchase_case_records(*, purchase: Purchase) -> CaseRecords:
    """Four queries (attempts, executions, refunds, escalations), plus one each for the
    result and the receipt unless the purchase was read with select_related("result",
    "receipt")."""
    refunds = tuple(payment_selectors.refunds_for_purchase(purchase_id=purchase.pk))
    attempts = tuple(purchase.payment_attempts.order_by("pk"))
    for attempt in attempts:
        # A refund names the purchase of the payment it returns (payments.services): the
        # attempt's own are among the purchase's, so they are handed over as a prefetch.
        mine = [r for r in refunds if r.payment_attempt_id == attempt.pk]
        queryset = attempt.refunds.all()
        queryset._result_cache = mine
        queryset._prefetch_done = True  # type: ignore[attr-defined]
        attempt._prefetched_objects_cache = {"refunds": queryset}  # type: ignore[attr-defined]
    return CaseRecords(
        attempts=attempts,
        executions=tuple(fulfillment_selectors.execution_attempts(purchase_id=purchase.pk)),
        refunds=refunds,
        escalations=tuple(purchase.escalations.order_by("pk")),
        result=_related_one(purchase, "result"),
        receipt=_related_one(purchase, "receipt"),
    )


def _landable_window(records: CaseRecords) -> datetime | None:
    """The latest window of an authorization that can still land: one that settled, whose
    late or duplicate transfer is owed back, or whose nonce another transfer used is spent."""
    spent = {
        a.pk
        for a in records.attempts
        if a.state == PaymentAttempt.State.SUCCEEDED
        or a.reason_code == "authorization_used_elsewhere"
    }
    spent |= {r.payment_attempt_id for r in records.refunds if r.reason_code in (LATE, DUPLICATE)}
    windows = [a.valid_before_at for a in records.attempts if a.pk not in spent]
    return max((w for w in windows if w is not None), default=None)


def purchase_case_facts(
    *, purchase: Purchase, now: datetime, records: CaseRecords | None = None
) -> CaseFacts:
    """What the case file's "Now" is derived from (purchases.case_file.purchase_case); from
    `records` when the page has read them already."""
    records = records or purchase_case_records(purchase=purchase)
    attempts = records.attempts
    pending = [
        a
        for a in attempts
        if a.state in (PaymentAttempt.State.RECORDED, PaymentAttempt.State.SETTLEMENT_PENDING)
    ]
    # A fresh attempt not yet broadcast belongs to the paying request for the grace period;
    # after it (or once broadcast) a look-up from anywhere is safe.
    grace_cutoff = now - settings.TOLLBOOTH["SETTLEMENT_GRACE"]
    look_up_safe = [a for a in pending if a.broadcast_started_at or a.created_at <= grace_cutoff]
    windows = [a.valid_before_at for a in attempts if a.valid_before_at]
    live_execution = next((e for e in records.executions if e.state == "running"), None)
    result = records.result
    open_escalations = [e for e in records.escalations if e.state == Escalation.State.OPEN]
    # While a settlement is pending, reconciliation keeps the attempt's reason current (the
    # purchase's is the one it was parked with): the case reads the fresher one.
    reason_code = (pending[-1].reason_code if pending else "") or purchase.reason_code
    live = pending[-1] if pending else None
    tb = settings.TOLLBOOTH
    return CaseFacts(
        payment_state=str(purchase.payment_state),
        fulfillment_state=str(purchase.fulfillment_state),
        reason_code=reason_code,
        rail=purchase.rail,
        amount=purchase.amount,
        updated_at=purchase.updated_at,
        quote_expires_at=purchase.quote.expires_at,
        failed_final_after=settings.TOLLBOOTH["FAILED_FINAL_AFTER"],
        sweep_grace=settings.TOLLBOOTH["SWEEP_GRACE"],
        has_pending_attempt=bool(look_up_safe),
        next_check_at=pending[-1].next_check_at if pending else None,
        valid_before_at=max(windows) if windows else None,
        landable_valid_before_at=_landable_window(records),
        lease_expires_at=live_execution.lease_expires_at if live_execution else None,
        execution_recheck_at=next(
            (e.next_check_at for e in reversed(records.executions) if e.state == "unknown"), None
        ),
        result_expires_at=result.expires_at if result else None,
        result_delivered_at=result.first_delivered_at if result else None,
        escalations=tuple(
            EscalationFact(e.pk, e.owner, e.reason_code, e.deadline_at) for e in open_escalations
        ),
        refunds=tuple(RefundFact(r.pk, r.state, r.reason_code, r.amount) for r in records.refunds),
        settlement_grace=tb["SETTLEMENT_GRACE"],
        pending_created_at=live.created_at if live else None,
        pending_broadcast_at=live.broadcast_started_at if live else None,
        pending_tx_hash=(live.tx_hash or "") if live else "",
        settlement_escalates_at=(live.broadcast_started_at or live.created_at)
        + tb["RECONCILIATION_DEADLINE"]
        if live
        else None,
        relayer_gap=_relayer_gap(live, now) if live else None,
        void_sweep_at=_void_sweep_at(purchase, attempts),
        execution=_execution_fact(purchase, live_execution),
        unfinal=_unfinal_fact(attempts, now),
    )


# The finality watch's beat (config/settings/base.py, watch-unfinal-settlements): an attempt
# due already is looked at by its next run.
FINALITY_WATCH_EVERY = timedelta(seconds=30)


def _unfinal_fact(attempts: Iterable[PaymentAttempt], now: datetime) -> UnfinalFact | None:
    """The settled x402 attempt the finality watch still looks at, as the watch reads it
    (purchases.services.settle.finality._claim_due): succeeded, `final_at` empty."""
    attempt = next(
        (
            a
            for a in reversed(list(attempts))
            if a.rail == "x402" and a.state == PaymentAttempt.State.SUCCEEDED and a.final_at is None
        ),
        None,
    )
    if attempt is None:
        return None
    try:
        network = network_config(attempt.network)
        policy, needed, confirmations = (
            network.finality,
            network.finality_depth,
            network.confirmations,
        )
    except UnknownNetwork:
        policy, needed, confirmations = "depth", 0, 0
    seen = attempt.finality_seen or {}
    if seen.get("block_number") != attempt.block_number:
        seen = {}  # a look at the block it was in before a reorg moved it
    due = attempt.next_check_at
    checked = seen.get("checked_at")
    return UnfinalFact(
        attempt_id=attempt.pk,
        tx_hash=attempt.tx_hash or "",
        block_number=attempt.block_number,
        policy=policy,
        depth_needed=needed,
        confirmations=confirmations,
        settled_at=attempt.updated_at,
        next_check_at=due if due and due > now else now + FINALITY_WATCH_EVERY,
        escalates_at=attempt.updated_at + settings.TOLLBOOTH["RECONCILIATION_DEADLINE"],
        depth_seen=seen.get("depth"),
        finalized_block_seen=seen.get("finalized_block"),
        checked_at=datetime.fromtimestamp(checked, tz=UTC) if checked else None,
    )


def _void_sweep_at(purchase: Purchase, attempts: Iterable[PaymentAttempt]) -> datetime | None:
    """From when finalize_failed_purchases may mark a failed purchase void: FAILED_FINAL_AFTER
    after it failed, and not before every authorization's window closed (its own rule)."""
    if purchase.payment_state != PAY.FAILED:
        return None
    at = purchase.updated_at + settings.TOLLBOOTH["FAILED_FINAL_AFTER"]
    windows = [a.valid_before_at for a in attempts if a.rail == "x402" and a.valid_before_at]
    return max([at, *windows])


RELAYER_GAP_SPAN = 256


def _relayer_gap(attempt: PaymentAttempt, now: datetime) -> RelayerGapFact | None:
    """An earlier relayer nonce of ours on the same network that may never have been mined:
    a dropped transaction whose authorization then expired (its nonce left unused) or a
    nonce handed out and never sent. The heal job fills such a gap within its interval, so
    only one older than that is no longer named."""
    if attempt.relayer_nonce is None:
        return None
    heal_every = HEAL_EVERY
    below = (
        PaymentAttempt.objects.filter(
            network=attempt.network,
            # A short range of nonces just below ours (by index): a gap far below would
            # have stalled everything long ago and been healed.
            relayer_nonce__lt=attempt.relayer_nonce,
            relayer_nonce__gte=max(attempt.relayer_nonce - RELAYER_GAP_SPAN, 0),
            updated_at__gte=now - heal_every,
        )
        .filter(
            Q(state=PaymentAttempt.State.FAILED, reason_code="authorization_expired_unused")
            | Q(state__in=PENDING_ATTEMPT_STATES, raw_transaction="")
        )
        .order_by("relayer_nonce")
        .values_list("pk", "relayer_nonce", "updated_at")
        .first()
    )
    if below is None:
        return None
    pk, nonce, updated_at = below
    return RelayerGapFact(pk, nonce, attempt.relayer_nonce, updated_at + heal_every)


def _execution_fact(purchase: Purchase, run: ExecutionAttempt | None) -> ExecutionFact | None:
    """The live execution, with its latest try that ended unknown (one read, only while
    running): the worker holds such work over the backoff, it is not simply "running"."""
    if run is None:
        return None
    retried = (
        purchase.events.filter(subject=EXECUTION_RETRIED, evidence__attempt=run.pk)
        .order_by("-pk")
        .values_list("evidence", "created_at")
        .first()
    )
    fact = ExecutionFact(
        worker=run.worker,
        tries=run.tries,
        max_tries=int(settings.TOLLBOOTH["EXECUTION_MAX_TRIES"]),
        give_up_at=run.started_at + settings.TOLLBOOTH["EXECUTION_DEADLINE"],
    )
    if retried is None:
        return fact
    evidence, at = retried
    retry_in = timedelta(seconds=float(evidence.get("retry_in_seconds") or 0))
    deadline_at = evidence.get("deadline_at")
    return replace(
        fact,
        failed_tries=int(evidence.get("try") or 0),
        last_error=str(evidence.get("error") or ""),
        retry_at=at + retry_in,
        # The budget the try was judged by: the offering's upstream may set its own.
        max_tries=int(evidence.get("max_tries") or fact.max_tries),
        give_up_at=datetime.fromisoformat(deadline_at) if deadline_at else fact.give_up_at,
    )


# --- the back-office dashboard ------------------------------------------------------------
OUTCOMES = ("done", "in_progress", "payment_failed", "work_failed", "work_unknown")


def purchase_outcome(*, payment_state: str, fulfillment_state: str) -> str:
    """One word per purchase for the dashboard chart."""
    if payment_state in (PAY.FAILED, PAY.VOID, PAY.REVERSED):
        return "payment_failed"
    if fulfillment_state == RUN.FAILED:
        return "work_failed"
    if fulfillment_state == RUN.UNKNOWN:
        return "work_unknown"
    if payment_state == PAY.PAID and fulfillment_state == RUN.SUCCEEDED:
        return "done"
    return "in_progress"


def dashboard_figures(*, now: datetime, days: int = 14) -> dict[str, Any]:
    """What support and finance look at first: the oldest pending settlement, unknown
    executions, refunds owed per asset, overdue escalations, purchases by outcome per day."""
    pending = (
        PaymentAttempt.objects.filter(
            state__in=(PaymentAttempt.State.RECORDED, PaymentAttempt.State.SETTLEMENT_PENDING)
        )
        .select_related("purchase")
        .order_by("created_at", "pk")
    )
    owed = (
        Refund.objects.filter(state=Refund.State.OWED)
        .values("asset")
        .annotate(total=Sum("amount"), count=Count("pk"))
        .order_by("asset")
    )
    units = {o.asset: (o.asset_symbol, o.asset_decimals) for o in Offering.objects.all()}
    overdue = (
        Escalation.objects.filter(state=Escalation.State.OPEN, deadline_at__lt=now)
        .select_related("purchase")
        .order_by("deadline_at", "pk")
    )
    since = (now - timedelta(days=days - 1)).date()
    per_day = (
        Purchase.objects.filter(created_at__date__gte=since)
        .annotate(day=TruncDate("created_at"))
        .values("day", "payment_state", "fulfillment_state")
        .annotate(count=Count("pk"))
    )
    chart: dict[Any, dict[str, int]] = {
        since + timedelta(days=i): dict.fromkeys(OUTCOMES, 0) for i in range(days)
    }
    for row in per_day:
        outcome = purchase_outcome(
            payment_state=row["payment_state"], fulfillment_state=row["fulfillment_state"]
        )
        chart.setdefault(row["day"], dict.fromkeys(OUTCOMES, 0))[outcome] += row["count"]
    return {
        "oldest_pending": pending.first(),
        "pending_count": pending.count(),
        "unknown_executions": list(
            Purchase.objects.filter(fulfillment_state=RUN.UNKNOWN).order_by("updated_at")[:20]
        ),
        "unknown_count": Purchase.objects.filter(fulfillment_state=RUN.UNKNOWN).count(),
        "refunds_owed": [
            {
                "asset": row["asset"],
                "symbol": units.get(row["asset"], ("", 6))[0],
                "amount": Decimal(row["total"]).scaleb(-units.get(row["asset"], ("", 6))[1]),
                "atomic": row["total"],
                "count": row["count"],
            }
            for row in owed
        ],
        # Proposed by support, waiting for finance's decision on the purchase page.
        "refunds_proposed": list(
            Refund.objects.filter(state=Refund.State.PROPOSED)
            .select_related("purchase")
            .order_by("created_at", "pk")[:20]
        ),
        "overdue_escalations": list(overdue[:20]),
        "overdue_count": overdue.count(),
        "chart": sorted(chart.items()),
    }


_HEX = re.compile(r"0x[0-9a-f]+")
SEARCH_MATCHES_MAX = 1000


# What a purchase search can look at, named as the admin's search fields (role-scoped).
SEARCH_KINDS = (
    "ref",
    "buyer__ref",
    "payer",
    "payment_attempts__tx_hash",
    "payment_attempts__payer",
    "refunds__transaction",
    "refunds__paid_reference",
    "refunds__payer",
)


def _touched_arms(hex_term: str, kinds: set[str]) -> list[Any]:
    """Every tx hash and wallet a purchase touched besides its payer: each attempt's tx hash
    and payer (a second authorization may come from another wallet), the transfer a refund
    returns (a late or duplicate one), its pay-back's hash and the wallet it is owed to."""
    paid_back = Refund.objects.alias(reference_lower=Lower("paid_reference"))
    candidates = {
        "payment_attempts__tx_hash": PaymentAttempt.objects.filter(tx_hash=hex_term),
        "payment_attempts__payer": PaymentAttempt.objects.filter(payer=hex_term),
        "refunds__transaction": Refund.objects.filter(transaction=hex_term),
        "refunds__paid_reference": paid_back.filter(reference_lower=hex_term),
        "refunds__payer": Refund.objects.filter(payer=hex_term),
    }
    return [q.values("purchase_id") for kind, q in candidates.items() if kind in kinds]


def purchase_search_ids(*, term: str, kinds: Iterable[str] = SEARCH_KINDS) -> list[int]:
    """The purchases an exact support search names: purchase ref, buyer ref, payment id,
    any transaction hash or wallet it touched (`_touched_arms`), as far as `kinds` (what the
    searcher may see) allows; a payment id goes with the ref. One query, each arm an index
    lookup.

    The term is normalised, not the column: hex (wallets, hashes) is matched lower-case, as
    stored; refs and payment ids are case-sensitive and matched as typed. A payment id past
    retention is kept only as its hash, so its hash is looked up too.
    """
    term, kinds = term.strip(), set(kinds)
    if not term or not kinds:
        return []
    lowered = term.lower()
    hex_term = lowered if _HEX.fullmatch(lowered) else None
    keys = [term, payment_id_hash(term)]
    arms = []
    if "ref" in kinds:
        arms += [
            Purchase.objects.filter(ref=term).values("pk"),
            # The payment id lives on the key: its purchase, or the attempt recorded under it.
            IdempotencyRecord.objects.filter(key__in=keys, purchase__isnull=False).values(
                "purchase_id"
            ),
            PaymentAttempt.objects.filter(idempotency_record__key__in=keys).values("purchase_id"),
        ]
    if "buyer__ref" in kinds:
        arms.append(Purchase.objects.filter(buyer__ref=term).values("pk"))
    if hex_term is not None and "payer" in kinds:
        arms.append(
            Purchase.objects.alias(payer_lower=Lower("payer"))
            .filter(payer_lower=hex_term)
            .values("pk")
        )
    if hex_term is not None:
        arms += _touched_arms(hex_term, kinds)
    if not arms:
        return []
    first, *rest = arms
    # UNION (not OR over joins): each arm keeps its own index; no DISTINCT over the table.
    return list(first.union(*rest).values_list("pk", flat=True)[:SEARCH_MATCHES_MAX])


# What a refund search can look at, named as the refund admin's search fields (role-scoped).
REFUND_SEARCH_KINDS = ("purchase__ref", "payer", "transaction", "paid_reference")


def refund_search_ids(*, term: str, kinds: Iterable[str] = REFUND_SEARCH_KINDS) -> list[int]:
    """The refunds an exact search names: its purchase's ref (as typed, refs are
    case-sensitive), the wallet owed, the transfer refunded (hex, matched lower-case as
    stored), or the pay-back's reference (matched lower-case, as finance typed it). One
    query, a UNION whose arms are each an index look-up; an OR of them across the join
    read every refund (9 s at a million)."""
    term, kinds = term.strip(), set(kinds)
    if not term or not kinds:
        return []
    lowered = term.lower()
    hex_term = lowered if _HEX.fullmatch(lowered) else None
    arms = []
    if "purchase__ref" in kinds:
        arms.append(Refund.objects.filter(purchase__ref=term).values("pk"))
    if hex_term is not None and "payer" in kinds:
        arms.append(Refund.objects.filter(payer=hex_term).values("pk"))
    if hex_term is not None and "transaction" in kinds:
        arms.append(Refund.objects.filter(transaction=hex_term).values("pk"))
    if "paid_reference" in kinds:
        paid_back = Refund.objects.alias(reference_lower=Lower("paid_reference"))
        arms.append(paid_back.filter(reference_lower=lowered).values("pk"))
    if not arms:
        return []
    first, *rest = arms
    return list(first.union(*rest).values_list("pk", flat=True)[:SEARCH_MATCHES_MAX])


# Reads the services ask for (they only query and return).

# A payment in one of these states is the purchase a retry repeats; a failed one is not.
# A held authorization (its work running) is repeated too; a released one (the work provably
# failed, nothing charged) is not: a retry is a fair new attempt.
DUPLICATE_REPEATABLE_STATES = (PAY.AUTHORIZED, PAY.PAYING, PAY.SETTLEMENT_PENDING, PAY.PAID)


def purchases_repeated(
    *, offering_id: Any, window: Any, duplicate_key: Any, now: datetime
) -> QuerySet[Purchase]:
    """The duplicate window's one rule: the purchases a new payment with `duplicate_key`
    repeats, newest first: the offering's, with that key, recorded inside its window (a zero
    window is off) and not failed. Each of `offering_id`, `window` and `duplicate_key` is a
    value or an expression (an OuterRef), so the same rule also annotates the read of an
    offering or a quote (purchases.services.checkout.duplicates)."""
    if not hasattr(window, "resolve_expression"):
        window = Value(window, output_field=DurationField())
    since = ExpressionWrapper(
        Value(now, output_field=DateTimeField()) - window, output_field=DateTimeField()
    )
    return Purchase.objects.filter(
        # A zero window is off: `since` alone would still match a payment recorded after
        # `now` (two payments of one quote racing).
        GreaterThan(window, Value(timedelta(0))),
        offering_id=offering_id,
        duplicate_key=duplicate_key,
        created_at__gt=since,
        payment_state__in=DUPLICATE_REPEATABLE_STATES,
    ).order_by("-pk")


def purchase_duplicate_find(
    *, offering: Offering, duplicate_key: str, now: datetime
) -> Purchase | None:
    """The purchase a new payment with this key repeats, if one is inside the window."""
    if not offering.duplicate_window:
        return None
    repeated = purchases_repeated(
        offering_id=offering.pk,
        window=offering.duplicate_window,
        duplicate_key=duplicate_key,
        now=now,
    )
    return repeated.select_related("offering", "quote").first()


def purchase_status_of(*, ref: str, now: datetime) -> dict[str, Any] | None:
    """The status document of purchase `ref` (None if there is none): for a door whose
    refusal names a purchase and must say whether its buyer was charged."""
    purchase = Purchase.objects.select_related("offering", "quote").filter(ref=ref).first()
    return None if purchase is None else purchase_status(purchase=purchase, now=now)


def purchase_reload(*, purchase: Purchase) -> Purchase:
    # A fresh instance, not refresh_from_db(): django-fsm's refresh toggles `protected` on
    # the shared field object, which is not safe with threads serving requests.
    return _PURCHASE_READ.get(pk=purchase.pk)


# The answer's read of a purchase, compiled once per process (core.prepared).
_PURCHASE_READ = PreparedQuery(
    lambda pk: Purchase.objects.select_related("offering", "quote").filter(pk=pk), pk=int
)


def purchases_awaiting_execution(*, now: datetime | None = None, limit: int = 500) -> list[int]:
    """Queued past the grace period, or running on an attempt whose lease has expired."""
    now = now_or(now)
    grace_cutoff = now - settings.TOLLBOOTH["SWEEP_GRACE"]
    expired_lease = ExecutionAttempt.objects.filter(
        state=ExecutionAttempt.State.RUNNING, lease_expires_at__lte=now
    ).values("purchase_id")
    ids = (
        Purchase.objects.filter(
            Q(fulfillment_state=Purchase.FulfillmentState.QUEUED, updated_at__lte=grace_cutoff)
            | Q(fulfillment_state=Purchase.FulfillmentState.RUNNING, pk__in=expired_lease)
        )
        .order_by("updated_at")
        .values_list("pk", flat=True)[:limit]
    )
    return list(ids)


# A sender that claimed an alert and did not finish within this is presumed dead.
ALERT_CLAIM_LEASE = timedelta(minutes=10)


def alert_unsent() -> Q:
    """An alert nobody sent yet, nor is sending (a claim older than the lease is dead)."""
    stale = timezone.now() - ALERT_CLAIM_LEASE
    return Q(alerted_at__isnull=True) & (
        Q(alert_claimed_at__isnull=True) | Q(alert_claimed_at__lt=stale)
    )


def refunds_awaiting_alert(*, limit: int = 200) -> list[int]:
    return list(
        Refund.objects.filter(alert_unsent(), state=Refund.State.OWED)
        .order_by("pk")
        .values_list("pk", flat=True)[:limit]
    )


def escalations_awaiting_alert(*, limit: int = 200) -> list[int]:
    return list(
        Escalation.objects.filter(alert_unsent(), state=Escalation.State.OPEN)
        .order_by("pk")
        .values_list("pk", flat=True)[:limit]
    )


def seller_wallets(*, network: str | None = None) -> set[str]:
    """The seller's own wallets on `network` (None: on every network), lower-case: the
    offerings' recipients, the relayers, and any listed in settings
    (TOLLBOOTH_SELLER_WALLETS). A refund's payback is trusted only from one of them
    (purchases.services.remedy.paybacks); the books flag a payment from one as no revenue."""
    offerings = Offering.objects.all()
    if network is not None:
        offerings = offerings.filter(network=network)
    recipients = offerings.values_list("pay_to", flat=True)
    return {a.lower() for a in recipients if a} | payment_selectors.payments_wallets(
        network=network
    )
