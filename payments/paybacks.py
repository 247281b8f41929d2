"""Chain refunds closed on evidence: a payback is judged on chain (payments.rails.x402.payback)
before it closes anything, and transfers that would pay an owed refund are offered as
matches.

The phases keep network I/O out of locks: `refund_payback_verify` and `refund_payback_find`
ask the chain with no transaction open; `refund_payback_record` and `refund_match_record`
lock the refund, re-check and write. The purchases orchestration holds the purchase lock
around them and writes the timeline (purchases.services.remedy.paybacks).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from eth_utils import is_address

from core.changes import Change
from payments.models import LIVE_PAYOUT_STATES, Payout, Refund
from payments.rails.x402.chain import ChainReader
from payments.rails.x402.networks import UnknownNetwork, network_config
from payments.rails.x402.payback import (
    PaybackCode,
    PaybackOwed,
    PaybackVerdict,
    Transfer,
    payback_candidates,
    payback_judge,
)
from payments.services import RefundReferenceInvalid

PAYBACK_FIELDS = (
    "payback_tx_hash",
    "payback_log_index",
    "payback_block_number",
    "payback_code",
    "payback_evidence",
    "payback_checked_at",
    "payback_next_check_at",
)
MATCH_FIELDS = ("match_tx_hash", "match_log_index", "match_block_number", "match_found_at")


class RefundPaybackRefused(RefundReferenceInvalid):
    """The transaction does not pay this refund back; `code` names the failed check."""

    def __init__(self, verdict: PaybackVerdict) -> None:
        super().__init__(f"{verdict.code.value}: {verdict.message}")
        self.verdict = verdict
        self.code = verdict.code


def _used_logs(*, network: str, tx_hashes: set[str], exclude: int | None) -> frozenset:
    """(tx, log) pairs among `tx_hashes` that already close or are claimed by a refund."""
    rows = Refund.objects.filter(
        network=network, payback_tx_hash__in=tx_hashes, payback_log_index__isnull=False
    ).exclude(pk=exclude)
    return frozenset(rows.values_list("payback_tx_hash", "payback_log_index"))


def _owed(
    refund: Refund, seller_wallets: set[str], used: frozenset, destination: str | None = None
) -> PaybackOwed:
    """Raises UnknownNetwork."""
    return PaybackOwed(
        network=network_config(refund.network),
        destination=destination or refund.payer,
        amount=refund.amount,
        seller_wallets=frozenset(w.lower() for w in seller_wallets),
        used_logs=used,
    )


def refund_payback_verify(
    *,
    refund_id: int,
    tx_hash: str,
    seller_wallets: set[str],
    reader: ChainReader | None = None,
    destination: str | None = None,
) -> PaybackVerdict:
    """Ask the chain whether `tx_hash` pays refund `refund_id` back. No transaction may be
    open (it is network I/O); the verdict is recorded by refund_payback_record.
    `destination`: another wallet than the payer's, for a payout two people approved."""
    refund = Refund.objects.get(pk=refund_id)
    tx_hash = tx_hash.strip().lower()
    live = refund.payouts.filter(state__in=LIVE_PAYOUT_STATES).exclude(tx_hash=tx_hash)
    if live.exists():
        # Closing it by another transfer would let the payout pay it a second time.
        return PaybackVerdict(PaybackCode.PAYOUT_LIVE, tx_hash)
    used = _used_logs(network=refund.network, tx_hashes={tx_hash}, exclude=refund.pk)
    try:
        owed = _owed(refund, seller_wallets, used, destination)
    except UnknownNetwork:
        return PaybackVerdict(PaybackCode.NETWORK_UNKNOWN, tx_hash)
    if not is_address(owed.network.token_address):
        return PaybackVerdict(PaybackCode.NETWORK_UNKNOWN, tx_hash)  # no token configured
    return payback_judge(tx_hash=tx_hash, owed=owed, reader=reader or ChainReader(owed.network))


@dataclass(frozen=True)
class PaybackRecorded:
    refund: Refund
    verdict: PaybackVerdict
    change: Change | None


def refund_payback_record(
    *, refund_id: int, verdict: PaybackVerdict, by: str, now: datetime
) -> PaybackRecorded:
    """Write what the chain said: closed (final), a pending claim looked at again at
    `payback_next_check_at`, or (refused) nothing but the end of this refund's claim on the
    transaction when it was the one claimed. The caller raises for a refusal after commit.

    Raises ValueError for a refund already paid back by another transaction, or not owed.
    """
    with transaction.atomic():
        refund = Refund.objects.select_for_update().get(pk=refund_id)
        if refund.state == Refund.State.PAID:
            if refund.paid_reference.lower() != verdict.tx_hash:
                raise ValueError(
                    f"refund {refund.pk} was already paid back as {refund.paid_reference}"
                )
            return PaybackRecorded(refund, verdict, None)
        if refund.state != Refund.State.OWED:
            raise ValueError(f"refund {refund.pk} is {refund.state}, not owed")
        if verdict.closes:
            return _close(refund, verdict, by, now)
        if verdict.pending:
            return PaybackRecorded(refund, verdict, _claim(refund, verdict, now))
        if refund.payback_tx_hash == verdict.tx_hash:
            return PaybackRecorded(refund, verdict, _drop_claim(refund, verdict, now))
    return PaybackRecorded(refund, verdict, None)


def _close(refund: Refund, verdict: PaybackVerdict, by: str, now: datetime) -> PaybackRecorded:
    assert verdict.log_index is not None and verdict.block_number is not None
    previous = refund.state
    refund.close_on_chain(
        tx_hash=verdict.tx_hash,
        log_index=verdict.log_index,
        block=verdict.block_number,
        by=by,
        at=now,
    )
    refund.payback_code, refund.payback_evidence = verdict.code.value, verdict.evidence
    refund.payback_checked_at = now
    refund.match_tx_hash, refund.match_log_index = "", None
    refund.match_block_number, refund.match_found_at = None, None
    fields = ["state", "paid_reference", "paid_by", "paid_at", *PAYBACK_FIELDS, *MATCH_FIELDS]
    try:
        with transaction.atomic():  # a savepoint: the losing writer of one log is refused
            refund.save(update_fields=fields)
    except IntegrityError:
        taken = PaybackVerdict(PaybackCode.ALREADY_USED, verdict.tx_hash)
        raise RefundPaybackRefused(taken) from None
    # A match offered to another refund for this log is spent now.
    Refund.objects.filter(
        network=refund.network, match_tx_hash=verdict.tx_hash, match_log_index=verdict.log_index
    ).exclude(pk=refund.pk).update(
        match_tx_hash="", match_log_index=None, match_block_number=None, match_found_at=None
    )
    change = Change(
        subject="refund",
        from_state=previous,
        to_state=refund.state,
        reason_code=verdict.code.value,
        evidence=_evidence(refund, verdict),
    )
    return PaybackRecorded(refund, verdict, change)


def _claim(refund: Refund, verdict: PaybackVerdict, now: datetime) -> Change | None:
    same = (refund.payback_tx_hash, refund.payback_code) == (verdict.tx_hash, verdict.code.value)
    refund.payback_tx_hash = verdict.tx_hash
    refund.payback_log_index, refund.payback_block_number = verdict.log_index, verdict.block_number
    refund.payback_code, refund.payback_evidence = verdict.code.value, verdict.evidence
    refund.payback_checked_at = now
    refund.payback_next_check_at = now + settings.TOLLBOOTH["PAYBACK_RECHECK"]
    try:
        with transaction.atomic():
            refund.save(update_fields=list(PAYBACK_FIELDS))
    except IntegrityError:
        raise RefundPaybackRefused(
            PaybackVerdict(PaybackCode.ALREADY_USED, verdict.tx_hash)
        ) from None
    if same:
        return None  # still pending for the same reason: nothing new for the timeline
    return Change(
        subject="refund",
        from_state=refund.state,
        to_state=refund.state,
        reason_code=verdict.code.value,
        evidence=_evidence(refund, verdict),
    )


def _drop_claim(refund: Refund, verdict: PaybackVerdict, now: datetime) -> Change:
    """The claimed transaction no longer pays it (e.g. a reorg took it out): owed, unclaimed."""
    refund.payback_tx_hash, refund.payback_log_index, refund.payback_block_number = "", None, None
    refund.payback_code, refund.payback_evidence = verdict.code.value, verdict.evidence
    refund.payback_checked_at, refund.payback_next_check_at = now, None
    refund.save(update_fields=list(PAYBACK_FIELDS))
    return Change(
        subject="refund",
        from_state=refund.state,
        to_state=refund.state,
        reason_code=verdict.code.value,
        evidence=_evidence(refund, verdict),
    )


def _evidence(refund: Refund, verdict: PaybackVerdict) -> dict[str, Any]:
    return {
        "refund": refund.pk,
        "tx_hash": verdict.tx_hash,
        "log_index": verdict.log_index,
        "block": verdict.block_number,
        **verdict.evidence,
    }


def refunds_payback_due(*, now: datetime, limit: int = 200) -> list[int]:
    """Owed refunds whose pending payback is due for another look."""
    rows = Refund.objects.filter(state=Refund.State.OWED, payback_next_check_at__lte=now)
    return list(rows.order_by("payback_next_check_at", "pk").values_list("pk", flat=True)[:limit])


def refunds_unmatched(*, limit: int = 500) -> list[Refund]:
    """Owed chain refunds with neither a payback named nor a match offered: the watch looks
    for their transfer."""
    rows = Refund.objects.filter(
        state=Refund.State.OWED, method=Refund.Method.PAY_BACK, payback_tx_hash="", match_tx_hash=""
    ).exclude(payouts__state__in=LIVE_PAYOUT_STATES)  # a payout closes those itself
    return list(rows.select_related("payment_attempt").order_by("pk")[:limit])


def refund_payback_find(
    *, refunds: list[Refund], network: str, seller_wallets: set[str]
) -> dict[int, Transfer]:
    """For refunds owed on `network`, the transfer on chain that would pay each back, one
    transfer per refund, oldest refund first. Network I/O: no transaction may be open.
    Raises ChainUnavailable and UnknownNetwork."""
    config = network_config(network)
    if not is_address(config.token_address):
        raise UnknownNetwork(f"{network} has no token configured")
    reader = ChainReader(config)
    by_destination: dict[tuple[str, int], list[Transfer]] = {}
    found: dict[int, Transfer] = {}
    taken: set[tuple[str, int]] = set(
        Refund.objects.filter(network=network, match_log_index__isnull=False).values_list(
            "match_tx_hash", "match_log_index"
        )
    )
    # A payout's transfer pays its own refund: never offered to another one.
    payout_txs = set(
        Payout.objects.filter(network=network, tx_hash__isnull=False).values_list(
            "tx_hash", flat=True
        )
    )
    for refund in refunds:
        owed = _owed(refund, seller_wallets, frozenset())
        attempt = refund.payment_attempt
        # The payback cannot be older than the payment it returns.
        start = attempt.block_number or attempt.search_from_block or 0
        key = (refund.payer.lower(), start)
        if key not in by_destination:
            by_destination[key] = payback_candidates(owed=owed, reader=reader, from_block=start)
        hashes = {t.tx_hash for t in by_destination[key]}
        used = _used_logs(network=network, tx_hashes=hashes, exclude=None) | taken
        for transfer in by_destination[key]:
            if (
                transfer.value == refund.amount
                and (transfer.tx_hash, transfer.log_index) not in used
                and transfer.tx_hash not in payout_txs
            ):
                found[refund.pk] = transfer
                taken.add((transfer.tx_hash, transfer.log_index))
                break
    return found


def refund_match_record(*, refund_id: int, transfer: Transfer, now: datetime) -> Change | None:
    """Offer `transfer` to finance as refund `refund_id`'s payback (nothing closes). None
    when the refund is no longer owed and unmatched, or another refund holds the match."""
    with transaction.atomic():
        refund = Refund.objects.select_for_update().get(pk=refund_id)
        if refund.state != Refund.State.OWED or refund.match_tx_hash or refund.payback_tx_hash:
            return None
        refund.match_tx_hash, refund.match_log_index = transfer.tx_hash, transfer.log_index
        refund.match_block_number, refund.match_found_at = transfer.block_number, now
        try:
            with transaction.atomic():
                refund.save(update_fields=list(MATCH_FIELDS))
        except IntegrityError:
            return None  # offered to another refund meanwhile
    return Change(
        subject="refund",
        from_state=refund.state,
        to_state=refund.state,
        reason_code="payback_match_found",
        evidence={
            "refund": refund.pk,
            "tx_hash": transfer.tx_hash,
            "log_index": transfer.log_index,
            "block": transfer.block_number,
            "from": transfer.sender,
        },
    )


def unmatched_networks(refunds: list[Refund]) -> dict[str, list[Refund]]:
    grouped: dict[str, list[Refund]] = {}
    for refund in refunds:
        grouped.setdefault(refund.network, []).append(refund)
    return grouped
