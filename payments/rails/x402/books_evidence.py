"""What the books need from a settlement's chain record: the settling block's timestamp (the
settlement time finance reports, in UTC) and the receipt's gas figures and sender.

Read once per settlement, from the receipt of the recorded transaction and its block, by one
reader (`settlement_block_record`): the finality watch when the block is final, the first
signed receipt that needs the settlement time, or lazily a books export for any settled
payment still without it (rows settled before the books existed, or not yet watched). A
chain that does not answer leaves the row as it was: it is looked up again next time, and
the export says how many are awaiting the chain (unknown is never told as anything else).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

from django.db.models import F, Q, Value
from django.db.models.functions import Coalesce

from payments.models import PaymentAttempt
from payments.rails.x402.chain import ChainReader, ChainUnavailable
from payments.rails.x402.networks import UnknownNetwork, network_config

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
            recorded += settlement_block_record(attempt=attempt, reader=reader) is not None
        except (ChainUnavailable, UnknownNetwork, ValueError) as exc:  # ValueError: not a hash
            logger.info("books: block time of attempt %s awaits the chain: %s", attempt.pk, exc)
    return recorded


def settlement_block_record(
    *, attempt: PaymentAttempt, reader: ChainReader | None = None
) -> datetime | None:
    """The one reader of a settlement's block: its transaction's receipt and that block's
    timestamp, read once, and everything the books and the receipts take from them recorded
    together (block_at, block_number, gas_used, effective_gas_price, sent_by), here and on
    `attempt`. Returns the block time recorded; None when the chain shows no successful
    receipt, or the attempt is no longer this settlement (a reorg in between reopened it).

    A block time already recorded is kept (the first recorded is the one a signed receipt
    states). Raises ChainUnavailable, UnknownNetwork, or ValueError for a stored hash that
    is not one. No transaction may be open."""
    if not attempt.tx_hash:
        return None
    reader = reader or _reader(attempt.network)
    receipt = reader.receipt(str(attempt.tx_hash))
    if receipt is None or receipt["status"] != 1:
        return None
    number = int(receipt["blockNumber"])
    block_at = datetime.fromtimestamp(reader.block_timestamp(number), tz=UTC)
    read = {
        "block_number": number,
        "gas_used": int(receipt["gasUsed"]),
        "effective_gas_price": int(receipt["effectiveGasPrice"]),
        "sent_by": str(receipt["from"]).lower(),
    }
    # Only while it is still this settlement (state and hash as read).
    written = PaymentAttempt.objects.filter(
        pk=attempt.pk, state=PaymentAttempt.State.SUCCEEDED, tx_hash=attempt.tx_hash
    ).update(block_at=Coalesce(F("block_at"), Value(block_at)), **read)
    if not written:
        return None
    for name, value in read.items():
        setattr(attempt, name, value)
    attempt.block_at = attempt.block_at or block_at
    return attempt.block_at


def _reader(network: str) -> ChainReader:
    return ChainReader(network_config(network))
