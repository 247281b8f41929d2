"""Finance approves a batch of owed chain refunds; Tollbooth pays them from the refund wallet.

Each payout is decided and recorded in one transaction (the purchase, the refund, the day's
cap and the wallet's nonce locked in that order): the cap is checked, the ERC-20 transfer is
signed with the wallet's next nonce, the signed bytes and hash are saved, the timeline says
so, and the broadcast job is staged in the outbox. Only after the commit is anything sent
(purchases.services.remedy.payout_reconcile). A destination other than the payer's is recorded
without a signature and waits for a second approver, a different staff user.

Lock order (core.locks): Purchase -> Refund -> Payout -> PayoutDay -> PayoutWallet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Sum
from eth_utils import is_address
from web3 import Web3

from core.actors import Actor
from core.changes import Change
from core.clock import now_or
from core.errors import DomainError, ErrorCode
from core.locks import lock_one, lock_rows
from payments.models import LIVE_PAYOUT_STATES, Payout, PayoutDay, Refund
from payments.payouts import (
    Awaiting,
    ChainPrep,
    payout_chain_prepare,
    payout_nonce_allocate,
    payout_transfer_sign,
)
from payments.rails.x402.chain import ChainUnavailable
from payments.rails.x402.networks import UnknownNetwork, network_config
from payments.rails.x402.types import NetworkConfig
from payments.signers import SignerUnconfigured, TransactionSigner, refund_signer
from purchases import event_subjects
from purchases.events import event_record_change
from purchases.models import Purchase
from purchases.services.shared.outbox import outbox_stage

logger = logging.getLogger(__name__)

BROADCAST_JOB = "payout_broadcast"


class PayoutRefused(DomainError):
    """An anticipated refusal: `code` says which (docs/errors.md); nothing was recorded."""


@dataclass
class PayoutBatch:
    payouts: list[Payout] = field(default_factory=list)
    refused: dict[int, PayoutRefused] = field(default_factory=dict)


def refunds_payout_approve(
    *,
    refund_ids: list[int],
    actor: Actor,
    destinations: dict[int, str] | None = None,
    now: datetime | None = None,
) -> PayoutBatch:
    """Finance's batch: one payout per refund, each in its own transaction (one refused
    refund, past the cap say, does not hold back the others). Refusals are returned by
    refund id, never raised."""
    batch = PayoutBatch()
    for refund_id in sorted(refund_ids):
        try:
            batch.payouts.append(
                refund_payout_approve(
                    refund_id=refund_id,
                    actor=actor,
                    destination=(destinations or {}).get(refund_id),
                    now=now,
                )
            )
        except PayoutRefused as exc:
            batch.refused[refund_id] = exc
    return batch


def refund_payout_approve(
    *, refund_id: int, actor: Actor, destination: str | None = None, now: datetime | None = None
) -> Payout:
    """Approve paying refund `refund_id` (owed, on chain) from the refund wallet, to the
    payer or, awaiting a second approver, to `destination`. Recorded before any broadcast.

    Raises PayoutRefused: payout_not_payable, payout_destination_invalid,
    payout_cap_exceeded, payout_wallet_unconfigured, payout_chain_unavailable.
    """
    now = now_or(now)
    refund = Refund.objects.get(pk=refund_id)
    _payable(refund)
    to = _destination(destination or refund.payer)
    network, signer = _wallet(refund)
    needs_second = to.lower() != refund.payer.lower()
    prep = None if needs_second else _prepare(network, signer)
    with transaction.atomic():
        purchase = lock_one(Purchase, refund.purchase_id)
        refund = lock_one(Refund, refund_id)
        _payable(refund)
        _cap_check(network=refund.network, asset=refund.asset, day=now.date(), amount=refund.amount)
        payout = Payout(
            refund=refund,
            network=refund.network,
            asset=refund.asset,
            destination=to,
            amount=refund.amount,
            approved_by=actor.name,
            approved_at=now,
            cap_day=now.date(),
            state=Payout.State.AWAITING_APPROVAL if needs_second else Payout.State.RECORDED,
        )
        if prep is None:
            payout.awaiting = Awaiting.SECOND_APPROVAL
            payout.save()
        else:
            _sign_and_stage(payout, signer, network, prep, now)
        event_record_change(purchase=purchase, actor=actor, change=_approved(payout))
    return payout


def payout_second_approve(*, payout_id: int, actor: Actor, now: datetime | None = None) -> Payout:
    """A second staff user approves a payout to another destination than the payer's: it is
    signed, recorded and staged for broadcast now.

    Raises PayoutRefused: payout_second_approver_required (the same person, or none),
    payout_not_payable (not awaiting approval, or its refund no longer owed),
    payout_wallet_unconfigured, payout_chain_unavailable.
    """
    now = now_or(now)
    payout = Payout.objects.select_related("refund").get(pk=payout_id)
    _second_approver_check(payout, actor)
    network, signer = _wallet(payout.refund)
    prep = _prepare(network, signer)
    with transaction.atomic():
        purchase = lock_one(Purchase, payout.refund.purchase_id)
        refund = lock_one(Refund, payout.refund_id)
        payout = lock_one(Payout, payout_id)
        _second_approver_check(payout, actor)
        if refund.state != Refund.State.OWED:
            raise PayoutRefused(
                ErrorCode.PAYOUT_NOT_PAYABLE, f"refund {refund.pk} is {refund.state}"
            )
        payout.approve_second(by=actor.name, at=now)
        _sign_and_stage(payout, signer, network, prep, now)
        event_record_change(purchase=purchase, actor=actor, change=_approved(payout))
    return payout


def payout_cancel(*, payout_id: int, actor: Actor) -> Payout:
    """Cancel a payout still awaiting its second approver (nothing was signed): its refund is
    owed again and its amount leaves the day's cap. Raises PayoutRefused
    (payout_not_payable) for any other payout."""
    payout = Payout.objects.select_related("refund").get(pk=payout_id)
    with transaction.atomic():
        purchase = lock_one(Purchase, payout.refund.purchase_id)
        payout = lock_one(Payout, payout_id)
        if payout.state != Payout.State.AWAITING_APPROVAL:
            raise PayoutRefused(
                ErrorCode.PAYOUT_NOT_PAYABLE, f"payout {payout.pk} is {payout.state}: signed"
            )
        previous = payout.state
        payout.cancel(reason_code="payout_cancelled")
        payout.awaiting = ""
        payout.save(update_fields=["state", "reason_code", "awaiting"])
        change = Change(
            subject=event_subjects.PAYOUT,
            from_state=previous,
            to_state=payout.state,
            reason_code="payout_cancelled",
            evidence={"payout": payout.pk, "refund": payout.refund_id, "by": actor.name},
        )
        event_record_change(purchase=purchase, actor=actor, change=change)
    return payout


def _second_approver_check(payout: Payout, actor: Actor) -> None:
    if payout.state != Payout.State.AWAITING_APPROVAL:
        raise PayoutRefused(
            ErrorCode.PAYOUT_NOT_PAYABLE, f"payout {payout.pk} is {payout.state}, not awaiting"
        )
    if not actor.name or actor.name == payout.approved_by:
        raise PayoutRefused(
            ErrorCode.PAYOUT_SECOND_APPROVER_REQUIRED,
            f"payout {payout.pk} to {payout.destination} (not the payer's wallet) needs a "
            f"second approver other than {payout.approved_by}",
        )


def _payable(refund: Refund) -> None:
    problem = ""
    if refund.method != Refund.Method.PAY_BACK or refund.state != Refund.State.OWED:
        problem = (
            f"refund {refund.pk} is not an owed chain refund ({refund.method}, {refund.state})"
        )
    elif refund.payback_tx_hash or refund.match_tx_hash:
        problem = f"refund {refund.pk} already has a payback named or matched on chain"
    elif refund.payouts.filter(state__in=LIVE_PAYOUT_STATES).exists():
        problem = f"refund {refund.pk} already has a live payout"
    if problem:
        raise PayoutRefused(ErrorCode.PAYOUT_NOT_PAYABLE, problem)


def _destination(address: str) -> str:
    address = (address or "").strip()
    if not is_address(address):
        raise PayoutRefused(ErrorCode.PAYOUT_DESTINATION_INVALID, f"{address!r} is no address")
    return Web3.to_checksum_address(address)


def _wallet(refund: Refund) -> tuple[NetworkConfig, TransactionSigner]:
    try:
        network = network_config(refund.network)
        signer = refund_signer(network=refund.network)
    except (UnknownNetwork, SignerUnconfigured) as exc:
        raise PayoutRefused(ErrorCode.PAYOUT_WALLET_UNCONFIGURED, str(exc)) from exc
    if not is_address(network.token_address):
        raise PayoutRefused(ErrorCode.PAYOUT_WALLET_UNCONFIGURED, f"{network.caip2}: no token")
    if refund.asset.lower() != network.token_address.lower():
        raise PayoutRefused(
            ErrorCode.PAYOUT_NOT_PAYABLE,
            f"refund {refund.pk} is in {refund.asset}, not {network.caip2}'s token",
        )
    return network, signer


def _prepare(network: NetworkConfig, signer: TransactionSigner) -> ChainPrep:
    try:
        return payout_chain_prepare(network=network, address=signer.address)
    except ChainUnavailable as exc:
        raise PayoutRefused(ErrorCode.PAYOUT_CHAIN_UNAVAILABLE, str(exc)) from exc


def payout_cap(*, asset: str) -> int:
    """The day's cap of `asset` in atomic units (0: nothing may be paid out)."""
    caps: dict[str, int] = settings.TOLLBOOTH.get("PAYOUT_DAILY_CAPS", {})
    return int(caps.get(asset.lower(), caps.get("*", 0)))


def payout_day_used(*, network: str, asset: str, day: date) -> int:
    """What the live payouts approved on `day` in `asset` hold against its cap."""
    rows = Payout.objects.filter(
        network=network, asset__iexact=asset, cap_day=day, state__in=LIVE_PAYOUT_STATES
    )
    return int(rows.aggregate(total=Sum("amount"))["total"] or 0)


def _cap_check(*, network: str, asset: str, day: date, amount: int) -> None:
    """Under the day's lock row: two approvals racing see each other's payouts."""
    key: dict[str, Any] = {"network": network, "asset": asset.lower(), "day": day}
    PayoutDay.objects.get_or_create(**key)
    lock_rows(PayoutDay.objects.filter(**key))
    cap, used = payout_cap(asset=asset), payout_day_used(network=network, asset=asset, day=day)
    if used + amount > cap:
        raise PayoutRefused(
            ErrorCode.PAYOUT_CAP_EXCEEDED,
            f"{amount} would take {day} (UTC) to {used + amount} of the cap {cap} "
            f"(atomic units of {asset}); {max(cap - used, 0)} left today",
        )


def _sign_and_stage(
    payout: Payout,
    signer: TransactionSigner,
    network: NetworkConfig,
    prep: ChainPrep,
    now: datetime,
) -> None:
    """Sign with the wallet's next nonce, save the bytes and hash, stage the broadcast."""
    nonce = payout_nonce_allocate(
        network=network.caip2, address=signer.address, floor=prep.pending_nonce
    )
    signed = payout_transfer_sign(
        signer=signer,
        network=network,
        destination=payout.destination,
        amount=payout.amount,
        nonce=nonce,
        fees=prep.fees,
    )
    payout.from_address = signer.address.lower()
    payout.nonce, payout.raw_transaction, payout.tx_hash = nonce, signed.raw, signed.tx_hash
    payout.awaiting = Awaiting.BROADCAST
    # The outbox sends it at once; if nothing did by then, the reconcile job does.
    payout.next_check_at = now + settings.TOLLBOOTH["PAYOUT_BROADCAST_GRACE"]
    payout.save()
    outbox_stage(
        job=BROADCAST_JOB, kwargs={"payout_id": payout.pk}, dedup_key=f"payout:{payout.pk}"
    )


def _approved(payout: Payout) -> Change:
    evidence: dict[str, Any] = {
        "payout": payout.pk,
        "refund": payout.refund_id,
        "destination": payout.destination,
        "amount": str(payout.amount),
        "approved_by": payout.approved_by,
    }
    if payout.tx_hash:
        evidence.update(tx_hash=payout.tx_hash, nonce=payout.nonce, wallet=payout.from_address)
    if payout.second_approved_by:
        evidence["second_approved_by"] = payout.second_approved_by
    return Change(
        subject=event_subjects.PAYOUT,
        from_state="awaiting_approval" if payout.second_approved_by else "",
        to_state=payout.state,
        reason_code="payout_approved",
        evidence=evidence,
    )
