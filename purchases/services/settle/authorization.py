"""The authorization flow (Offering.DeliveryCondition.AUTHORIZATION): run first, settle after.

The buyer's signed authorization is verified and recorded **held** (PaymentAttempt.State.HELD,
the purchase `authorized`): nobody broadcasts a held attempt. The work runs. Its terminal
move decides, in the same transaction that records the work's outcome:

    succeeded                 capture: the attempt goes back to `recorded` (the purchase to
                              `paying`) and its settlement is staged; the result is released
                              only once that settlement is confirmed, as `settled` does
    provably failed           release: never settled by us (attempt failed
                              `authorization_released`, purchase `released`); it lapses at
                              its validBefore, and a landing before then is late money owed back
    unknown (tries spent)     capture: settled, the outcome kept unknown (refund owed if it
                              later proves failed)

A held attempt whose work has not ended `AUTHORIZATION_SETTLE_MARGIN` before its validBefore is
captured by the beat sweep (settled, outcome unknown), and so is one whose work ended without
its move (a worker killed between the two). The staged settlement is a backstop: the paying
request settles at once itself when it is still waiting; otherwise the relay loop sends it
after its grace. Either way it is the same signed authorization, settled at most once.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from core.actors import Actor
from core.clock import now_or
from core.locks import locking
from payments.models import PaymentAttempt
from purchases.events import event_record, events_batched, purchase_transition
from purchases.models import Purchase
from purchases.services.shared.job_runs import job_run
from purchases.services.shared.outbox import outbox_stage

PAY = Purchase.PaymentState
RUN = Purchase.FulfillmentState
HELD = PaymentAttempt.State.HELD
SETTLE_CAPTURED_JOB = "payment_settle_captured"
# Reason codes on the timeline (why a held authorization was captured or released).
WORK_SUCCEEDED = "work_succeeded"
WORK_UNKNOWN = "work_outcome_unknown"
SETTLE_MARGIN_REACHED = "settle_margin_reached"
RELEASED = "authorization_released"


def purchase_is_held(purchase: Purchase) -> bool:
    """Its authorization is verified and held while the work runs (never broadcast)."""
    return str(purchase.payment_state) == PAY.AUTHORIZED


def authorization_hold(*, purchase: Purchase, attempt: PaymentAttempt, actor: Actor) -> None:
    """The attempt just recorded under the authorization flow is held, not settled.
    Caller holds the purchase's lock in the recording transaction."""
    attempt.hold()
    attempt.save(update_fields=["state", "updated_at"])
    event_record(
        subject="payment_attempt",
        purchase=purchase,
        actor=actor,
        from_state=PaymentAttempt.State.RECORDED,
        to_state=HELD,
        reason_code="authorization_held",
        evidence={
            "attempt": attempt.pk,
            "valid_before": attempt.valid_before_at.isoformat() if attempt.valid_before_at else "",
        },
    )


def authorization_capture(
    *, purchase: Purchase, actor: Actor, reason_code: str, now: datetime | None = None
) -> PaymentAttempt | None:
    """Settle the held authorization: the attempt back to `recorded`, the purchase to
    `paying`, its settlement staged. Caller holds the purchase's lock in the transaction of
    the work's terminal move. None when nothing is held (already captured or released)."""
    attempt = _held_attempt(purchase)
    if attempt is None:
        return None
    attempt.capture()
    attempt.save(update_fields=["state", "updated_at"])
    _attempt_moved(purchase, attempt, actor, reason_code)
    purchase_transition(
        purchase=purchase,
        transition=purchase.payment_capture,
        actor=actor,
        evidence={"attempt": attempt.pk, "reason": reason_code},
    )
    outbox_stage(
        job=SETTLE_CAPTURED_JOB,
        kwargs={"attempt_id": attempt.pk},
        dedup_key=f"{SETTLE_CAPTURED_JOB}:{attempt.pk}",
        now=now,
        relay_at_commit=False,  # the paying request, if still there, settles it at once
    )
    return attempt


def authorization_release(
    *, purchase: Purchase, actor: Actor, reason_code: str
) -> PaymentAttempt | None:
    """The work provably failed: never settle this authorization. Caller holds the purchase's
    lock. The attempt fails (`authorization_released`) and stays watched for a landing until
    its validBefore (late money, owed back: reconcile.watch_failed_attempts)."""
    attempt = _held_attempt(purchase)
    if attempt is None:
        return None
    attempt.release()
    attempt.save(update_fields=["state", "reason_code", "updated_at"])
    _attempt_moved(purchase, attempt, actor, RELEASED)
    purchase_transition(
        purchase=purchase,
        transition=purchase.payment_release,
        actor=actor,
        arguments={"reason_code": reason_code},
        update_fields=["reason_code"],
        evidence={
            "attempt": attempt.pk,
            "lapses_at": attempt.valid_before_at.isoformat() if attempt.valid_before_at else "",
        },
    )
    return attempt


def authorization_lapses_at(*, purchase: Purchase) -> datetime | None:
    """When the purchase's released (or held) authorization can no longer land."""
    attempt = purchase.payment_attempts.order_by("-pk").first()
    return attempt.valid_before_at if attempt is not None else None


def authorizations_held_sweep(*, now: datetime | None = None) -> Counter[str]:
    """Held attempts whose work ended without its terminal move deciding (captured or
    released here, as that move would have), or whose settle margin is reached while the
    work still runs (captured: settled, outcome unknown). JobRun `held_authorizations`."""
    now = now_or(now)
    margin = settings.TOLLBOOTH["AUTHORIZATION_SETTLE_MARGIN"]
    with job_run("held_authorizations", now) as stats:
        due = PaymentAttempt.objects.filter(state=HELD).filter(
            Q(valid_before_at__lte=now + margin)
            | Q(purchase__fulfillment_state__in=[RUN.SUCCEEDED, RUN.UNKNOWN, RUN.FAILED])
        )
        for purchase_id in due.values_list("purchase_id", flat=True)[:500]:
            stats[_decide(purchase_id, now)] += 1
    return stats


def _decide(purchase_id: int, now: datetime) -> str:
    actor = Actor.system("authorizations")
    with transaction.atomic(), events_batched():
        purchase = locking(Purchase.objects).select_related("offering").get(pk=purchase_id)
        if not purchase_is_held(purchase):
            return "moved"  # lost the race: its terminal move decided meanwhile
        state = str(purchase.fulfillment_state)
        if state == RUN.FAILED:
            authorization_release(purchase=purchase, actor=actor, reason_code=purchase.reason_code)
            return "released"
        reasons: dict[str, str] = {RUN.SUCCEEDED: WORK_SUCCEEDED, RUN.UNKNOWN: WORK_UNKNOWN}
        reason = reasons.get(state, SETTLE_MARGIN_REACHED)
        authorization_capture(purchase=purchase, actor=actor, reason_code=reason, now=now)
        return "captured"


def _held_attempt(purchase: Purchase) -> PaymentAttempt | None:
    return locking(PaymentAttempt.objects).filter(purchase_id=purchase.pk, state=HELD).first()


def _attempt_moved(
    purchase: Purchase, attempt: PaymentAttempt, actor: Actor, reason_code: str
) -> None:
    event_record(
        subject="payment_attempt",
        purchase=purchase,
        actor=actor,
        from_state=HELD,
        to_state=attempt.state,
        reason_code=reason_code,
        evidence={"attempt": attempt.pk},
    )
