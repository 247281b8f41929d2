"""Payouts after their record: the broadcast (an outbox job, after the commit) and the
reconcile job (beat), like a settlement's.

Only the payout's recorded bytes are ever sent. The reconcile job sends a payout recorded
but never broadcast (its worker died in between), re-sends one the node dropped (unknown to
it, its nonce still free), and looks at the rest when due: pending while the node holds it,
while it is not final, or while the node cannot be asked (with what it awaits and the next
check); confirmed when its transfer passes the same checks as a hand payback
(payments.paybacks: token, seller wallet, destination, amount, one log per refund,
finality), and then its refund closes as paid with the payout's transaction; failed only
on proof that no money moved and none can (reverted past finality, or its nonce taken by
another transaction past finality).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F

from core.actors import Actor
from core.changes import Change
from core.clock import now_or
from core.locks import lock_one
from payments import paybacks
from payments.models import Payout
from payments.paybacks import RefundPaybackRefused
from payments.payouts import Awaiting, Look, PayoutLook, Sent, payout_look, payout_send
from payments.rails.x402.networks import UnknownNetwork, network_config
from payments.rails.x402.types import NetworkConfig
from purchases import event_subjects
from purchases.events import event_record_change
from purchases.models import Purchase
from purchases.services.remedy.paybacks import seller_wallets
from purchases.services.shared.job_runs import job_run

logger = logging.getLogger(__name__)

SYSTEM = Actor.system("payout_reconcile")
DUE_LIMIT = 200


def payout_broadcast(*, payout_id: int, now: datetime | None = None) -> str:
    """Send a recorded payout's signed bytes (the outbox job, and the reconcile job for one
    never sent). Returns what happened; anything but a send leaves it recorded, due again."""
    now = now_or(now)
    payout = Payout.objects.get(pk=payout_id)
    if payout.state != Payout.State.RECORDED:
        return f"not_recorded:{payout.state}"
    network = _network(payout)
    if network is None:
        return "network_mismatch"
    Payout.objects.filter(pk=payout_id, state=Payout.State.RECORDED).update(
        broadcast_started_at=now
    )
    sent, said = payout_send(network=network, raw=payout.raw_transaction)
    with transaction.atomic():
        purchase = lock_one(Purchase, payout.refund.purchase_id)
        payout = lock_one(Payout, payout_id)
        if payout.state != Payout.State.RECORDED:
            return f"not_recorded:{payout.state}"  # the reconcile job sent it meanwhile
        arrived = sent in (Sent.SENT, Sent.KNOWN)
        if arrived:
            payout.mark_broadcast(at=now)
            payout.broadcasts += 1
        payout.awaiting = Awaiting.INCLUSION if arrived else Awaiting.BROADCAST
        payout.checked_at, payout.next_check_at = now, now + settings.TOLLBOOTH["PAYOUT_RECHECK"]
        payout.evidence = {"send": sent.value, **({"node_said": said} if said else {})}
        payout.save()
        event_record_change(
            purchase=purchase,
            actor=SYSTEM,
            change=Change(
                subject=event_subjects.PAYOUT_BROADCAST,
                from_state=Payout.State.RECORDED,
                to_state=payout.state,
                reason_code=f"payout_send_{sent.value}",
                evidence=_evidence(payout, said=said),
            ),
        )
    return sent.value


def payouts_reconcile(*, now: datetime | None = None) -> dict[str, int]:
    """The beat's pass over the payouts due (recorded past their grace, or pending and due
    for a look). Recorded as the job `payouts_reconcile`."""
    now = now_or(now)
    with job_run("payouts_reconcile", now) as stats:
        due = Payout.objects.filter(
            state__in=(Payout.State.RECORDED, Payout.State.BROADCAST), next_check_at__lte=now
        ).order_by("next_check_at", "pk")
        for payout_id, state in due.values_list("pk", "state")[:DUE_LIMIT]:
            if state == Payout.State.RECORDED:
                stats[f"broadcast_{payout_broadcast(payout_id=payout_id, now=now)}"] += 1
            else:
                stats[payout_check(payout_id=payout_id, now=now)] += 1
    return dict(stats)


def payout_check(*, payout_id: int, now: datetime | None = None) -> str:
    """Look at a broadcast payout on chain and record what the chain says. Returns the
    outcome: confirmed, failed, resent, or pending:<what it awaits>."""
    now = now_or(now)
    payout = Payout.objects.get(pk=payout_id)
    network = _network(payout)
    if network is None or payout.state != Payout.State.BROADCAST or payout.nonce is None:
        return "skipped"
    assert payout.tx_hash is not None
    look = payout_look(
        network=network,
        tx_hash=payout.tx_hash,
        from_address=payout.from_address,
        nonce=payout.nonce,
    )
    if look.look == Look.DROPPED:
        return _resend(payout, network, look, now)
    if look.look == Look.MINED:
        return _close(payout, look, now)
    if look.look in (Look.REVERTED, Look.NONCE_TAKEN) and look.final:
        return _fail(payout, look, now)
    awaiting = {
        Look.IN_POOL: Awaiting.INCLUSION,
        Look.UNAVAILABLE: Awaiting.NODE,
    }.get(look.look, Awaiting.FINALITY)
    _pend(payout_id, awaiting, {"look": look.look.value, **look.evidence}, now)
    return f"pending:{awaiting.value}"


def _network(payout: Payout) -> NetworkConfig | None:
    """The network, if this process is configured for the payout's token: a process pointed
    at another chain or token must not send (or judge) bytes signed for this one."""
    try:
        network = network_config(payout.network)
    except UnknownNetwork:
        network = None
    if network is None or network.token_address.lower() != payout.asset.lower():
        logger.error("payout %s: this process is not configured for its network and token",
                     payout.pk)  # fmt: skip
        return None
    return network


def _pend(payout_id: int, awaiting: Awaiting, evidence: dict[str, Any], now: datetime) -> None:
    Payout.objects.filter(pk=payout_id, state=Payout.State.BROADCAST).update(
        awaiting=awaiting,
        evidence=evidence,
        checked_at=now,
        next_check_at=now + settings.TOLLBOOTH["PAYOUT_RECHECK"],
    )


def _resend(payout: Payout, network: NetworkConfig, look: PayoutLook, now: datetime) -> str:
    """Dropped: the same signed bytes again (same nonce, same hash): never a new transfer."""
    sent, said = payout_send(network=network, raw=payout.raw_transaction)
    with transaction.atomic():
        purchase = lock_one(Purchase, payout.refund.purchase_id)
        Payout.objects.filter(pk=payout.pk).update(broadcasts=F("broadcasts") + 1)
        payout.refresh_from_db()
        event_record_change(
            purchase=purchase,
            actor=SYSTEM,
            change=Change(
                subject=event_subjects.PAYOUT_REBROADCAST,
                from_state=payout.state,
                to_state=payout.state,
                reason_code=f"payout_send_{sent.value}",
                evidence={**_evidence(payout, said=said), "broadcasts": payout.broadcasts},
            ),
        )
    arrived = sent in (Sent.SENT, Sent.KNOWN)
    evidence = {
        "look": look.look.value,
        "send": sent.value,
        **({"node_said": said} if said else {}),
    }
    _pend(payout.pk, Awaiting.INCLUSION if arrived else Awaiting.BROADCAST, evidence, now)
    return "resent" if arrived else f"resend_{sent.value}"


def _close(payout: Payout, look: PayoutLook, now: datetime) -> str:
    """Mined: judged as any payback is; closed (refund paid, payout confirmed) once final."""
    assert payout.tx_hash is not None
    verdict = paybacks.refund_payback_verify(
        refund_id=payout.refund_id,
        tx_hash=payout.tx_hash,
        seller_wallets=seller_wallets(network=payout.network),
        destination=payout.destination,
    )
    if verdict.pending:
        _pend(payout.pk, Awaiting.FINALITY, {"code": verdict.code.value, **verdict.evidence}, now)
        return f"pending:{Awaiting.FINALITY.value}"
    if not verdict.closes:
        logger.error("payout %s mined but refused as payback: %s", payout.pk, verdict.code)
        _pend(payout.pk, Awaiting.ATTENTION, {"code": verdict.code.value, **verdict.evidence}, now)
        return f"pending:{Awaiting.ATTENTION.value}"
    by = f"payout {payout.pk} ({payout.approved_by})"
    with transaction.atomic():
        purchase = lock_one(Purchase, payout.refund.purchase_id)
        try:
            recorded = paybacks.refund_payback_record(
                refund_id=payout.refund_id, verdict=verdict, by=by, now=now
            )
        except (RefundPaybackRefused, ValueError) as exc:
            transaction.set_rollback(True)
            logger.error("payout %s mined but its refund did not close: %s", payout.pk, exc)
            attention = True
        else:
            attention = False
            event_record_change(purchase=purchase, actor=SYSTEM, change=recorded.change)
            locked = lock_one(Payout, payout.pk)
            locked.confirm(block=look.block_number or 0, at=now)
            locked.checked_at, locked.evidence = now, {"code": verdict.code.value, **look.evidence}
            locked.save()
            event_record_change(purchase=purchase, actor=SYSTEM, change=_moved(locked, "broadcast"))
    if attention:
        _pend(payout.pk, Awaiting.ATTENTION, {"code": "refund_not_closed"}, now)
        return f"pending:{Awaiting.ATTENTION.value}"
    return "confirmed"


def _fail(payout: Payout, look: PayoutLook, now: datetime) -> str:
    """Proven: reverted past finality, or its nonce taken by another transaction past
    finality. No money moved: the refund is owed again (a new payout may be approved)."""
    with transaction.atomic():
        purchase = lock_one(Purchase, payout.refund.purchase_id)
        locked = lock_one(Payout, payout.pk)
        locked.reason_code = f"payout_{look.look.value}"
        locked.evidence = {"look": look.look.value, "block": look.block_number, **look.evidence}
        locked.checked_at = now
        locked.fail()
        locked.save()
        event_record_change(purchase=purchase, actor=SYSTEM, change=_moved(locked, "broadcast"))
    return "failed"


def _moved(payout: Payout, previous: str) -> Change:
    return Change(
        subject=event_subjects.PAYOUT,
        from_state=previous,
        to_state=payout.state,
        reason_code=payout.reason_code or f"payout_{payout.state}",
        evidence=_evidence(payout),
    )


def _evidence(payout: Payout, *, said: str = "") -> dict[str, Any]:
    evidence: dict[str, Any] = {
        "payout": payout.pk,
        "refund": payout.refund_id,
        "tx_hash": payout.tx_hash,
        "nonce": payout.nonce,
        "block": payout.block_number,
    }
    if said:
        evidence["node_said"] = said
    return evidence
