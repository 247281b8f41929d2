"""What the books need from a settlement's chain record: the settling block's timestamp (the
settlement time finance reports, in UTC) and the receipt's gas figures and sender.

Read once per settlement, from the receipt of the recorded transaction and its block: by the
finality watch when the block is final, and lazily by a books export for any settled
payment still without it (rows settled before the books existed, or not yet watched). A
chain that does not answer leaves the row as it was: it is looked up again next time, and
the export says how many are awaiting the chain (unknown is never told as anything else).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

from django.db.models import Q

from payments.models import PaymentAttempt
from payments.x402.chain import ChainReader, ChainUnavailable
from payments.x402.networks import UnknownNetwork, network_config

logger = logging.getLogger(__name__)


def settlements_awaiting_block_time(*, created_before: datetime) -> Iterable[PaymentAttempt]:
    """Settled x402 payments whose block time is not recorded yet, oldest first."""
    # A receipt may have recorded the block's time alone (purchases.services.fulfil.receipts): the
    # sender and gas are still to be read then.
    return PaymentAttempt.objects.filter(
        Q(block_at__isnull=True) | Q(sent_by=""),
        rail="x402",
        state=PaymentAttempt.State.SUCCEEDED,
        tx_hash__isnull=False,
        created_at__lt=created_before,
    ).order_by("pk")


def settlement_books_evidence_fill(
    *,
    attempts: Iterable[PaymentAttempt],
    reader_for: Callable[[str], ChainReader] | None = None,
) -> int:
    """Record the block time, gas and sender of each settled attempt from its receipt.

    Returns how many were recorded. An attempt whose receipt the chain does not show (a
    reorg undid it: the finality watch deals with that) or whose network cannot be asked is
    left as it was. No transaction is held while the chain is asked."""
    readers: dict[str, ChainReader] = {}
    recorded = 0
    for attempt in attempts:
        try:
            reader = readers.get(attempt.network) or (reader_for or _reader)(attempt.network)
            readers[attempt.network] = reader
            receipt = reader.receipt(str(attempt.tx_hash))
            if receipt is None or receipt["status"] != 1:
                continue
            stamp = reader.block_timestamp(int(receipt["blockNumber"]))
        except (ChainUnavailable, UnknownNetwork, ValueError) as exc:  # ValueError: not a hash
            logger.info("books: block time of attempt %s awaits the chain: %s", attempt.pk, exc)
            continue
        # Only while it is still this settlement: a reorg in between reopened it.
        recorded += PaymentAttempt.objects.filter(
            pk=attempt.pk, state=PaymentAttempt.State.SUCCEEDED, tx_hash=attempt.tx_hash
        ).update(
            block_at=datetime.fromtimestamp(stamp, tz=UTC),
            block_number=int(receipt["blockNumber"]),
            gas_used=int(receipt["gasUsed"]),
            effective_gas_price=int(receipt["effectiveGasPrice"]),
            sent_by=str(receipt["from"]).lower(),
        )
    return recorded


def _reader(network: str) -> ChainReader:
    return ChainReader(network_config(network))
