"""The revenue export of a closed period: one CSV, recorded with its SHA-256.

The file is a function of the record alone: rows in a fixed order, amounts as exact decimals
with the asset's symbol, times in UTC to the second, and no generation time inside. So a
re-export of a closed period is byte-identical, and its batch shows the same SHA-256 (as the
refund CSV's). What makes a period's file change is said in its notes lines: settlements not
final yet, and settlements whose block time the chain has not told us yet.

Rows (`record`): a note; a `sale` (settled payment), a `deposit` (an x402 top-up's
settlement: no revenue, counted in the prepaid rows), `refund` (paid back on chain) or
`credit` (credited to a prepaid balance); an `offering_total` per offering and asset and a
`total` per asset; and the prepaid balances per asset (held at the start, deposits,
consumption, credits, adjustments, held at the end).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.db import transaction

from backoffice.books import (
    NATIVE_DECIMALS,
    BookLine,
    Period,
    Totals,
    book_lines_stream,
    native_symbol,
    period_census,
    prepaid_movements,
    utc_text,
)
from core.clock import now_or
from core.exports import StreamSummary, csv_stream
from payments.models import ExportBatch, PaymentAttempt
from payments.rails.x402.books_evidence import (
    settlement_books_evidence_fill,
    settlements_awaiting_block_time,
)
from payments.services import export_batch_record
from purchases.models import Offering

BOOKS_CSV_COLUMNS = (
    "record", "time_utc", "offering", "purchase", "rail", "network", "asset_symbol", "asset",
    "payer", "transaction", "block", "self_payment", "revenue", "refunds", "credits",
    "excluded", "net", "gas", "gas_symbol", "held", "note",
)  # fmt: skip


@dataclass(frozen=True)
class BooksExport:
    content: bytes
    sha256: str
    row_count: int
    batch: ExportBatch


def units(atomic: int, decimals: int) -> str:
    """Exact asset units with every decimal place: 250000 at 6 is "0.250000"."""
    return f"{Decimal(atomic).scaleb(-decimals):.{decimals}f}"


def books_export_stream(
    *,
    period: Period,
    created_by: str,
    include_self_payments: bool = False,
    now: datetime | None = None,
    on_recorded: Callable[[ExportBatch], None] | None = None,
) -> Iterator[bytes]:
    """The period's books as CSV chunks, streamed, recorded when the last chunk is handed
    over: the batch's SHA-256 is of exactly the bytes yielded (hashed as they go), its row
    count theirs. A stream abandoned part way records nothing. `on_recorded` gets the batch.

    Checked before any byte is produced: settled payments still without their block's time
    are looked up on chain first (no transaction open); those the chain does not answer for
    are counted in a note. Raises PeriodInvalid (a ValueError) for a period not closed yet.
    """
    now = now_or(now)
    period.check_closed(now=now)
    settlement_books_evidence_fill(
        attempts=list(settlements_awaiting_block_time(created_before=period.end))
    )
    filters = {
        "period_start": utc_text(period.start),
        "period_end": utc_text(period.end),
        "include_self_payments": include_self_payments,
    }

    def record(summary: StreamSummary) -> None:
        batch = export_batch_record(
            kind="books",
            created_by=created_by,
            filters=filters,
            row_count=summary.row_count,
            sha256=summary.sha256,
            started_at=now,
            first_created_at=summary.first_created_at,
            last_created_at=summary.last_created_at,
        )
        if on_recorded is not None:
            on_recorded(batch)

    rows = _books_rows(period=period, include_self_payments=include_self_payments)
    return csv_stream(BOOKS_CSV_COLUMNS, rows, record)


def books_export(
    *,
    period: Period,
    created_by: str,
    include_self_payments: bool = False,
    now: datetime | None = None,
) -> BooksExport:
    """The whole file in memory, recorded (tests and small periods; the admin and the
    command stream). Raises PeriodInvalid as books_export_stream."""
    recorded: list[ExportBatch] = []
    content = b"".join(
        books_export_stream(
            period=period,
            created_by=created_by,
            include_self_payments=include_self_payments,
            now=now,
            on_recorded=recorded.append,
        )
    )
    (batch,) = recorded
    return BooksExport(content, batch.sha256, batch.row_count, batch)


def _books_rows(
    *, period: Period, include_self_payments: bool
) -> Iterator[tuple[list[str], datetime | None]]:
    """The file's data rows, each with its line's time (None for notes and totals).

    The notes come first and speak of the whole period, so they are counted by the database
    before the lines are read; the totals come last, summed as the lines go by. Memory holds
    a chunk of rows and the totals, never the period."""

    def values(row: dict[str, str]) -> list[str]:
        return [row.get(column, "") for column in BOOKS_CSV_COLUMNS]

    by_offering: dict[tuple[Any, ...], Totals] = defaultdict(Totals)
    by_unit: dict[tuple[Any, ...], Totals] = defaultdict(Totals)
    # One transaction: the server-side cursors stream (see book_lines_stream).
    with transaction.atomic():
        for note in _notes(period, include_self_payments):
            yield values(note), None
        for line in book_lines_stream(period=period):
            unit = (line.network, line.asset, line.symbol, line.decimals)
            for sums in (by_offering[(line.offering, *unit)], by_unit[unit]):
                sums.add(line, include_self_payments=include_self_payments)
            yield values(_line_row(line, include_self_payments)), line.at
    for row in _total_rows(dict(sorted(by_offering.items())), dict(sorted(by_unit.items()))):
        yield values(row), None
    for row in _prepaid_rows(period):
        yield values(row), None


def _notes(period: Period, include_self_payments: bool) -> Iterator[dict[str, str]]:
    census = period_census(period=period)
    yield _note(
        f"period {utc_text(period.start)} to {utc_text(period.end)} (UTC, end excluded); "
        "a sale is timed by its settling block's timestamp (prepaid: the debit), a refund "
        "or credit by when it was paid"
    )
    yield _note(
        "amounts in asset units, exact (smallest unit over the asset's decimals); gas is "
        "what our relayer paid per settlement and what a seller wallet paid per payback "
        "transaction (gasUsed x effectiveGasPrice, once per transaction), in the network's "
        "native coin, not converted; net = revenue - refunds - credits, before gas"
    )
    treated = "included in revenue (asked)" if include_self_payments else "excluded from revenue"
    yield _note(f"payments from the seller's own wallets: {census.self_payments}, {treated}")
    for network in census.facilitated_networks:
        yield _note(f"{network}: settled by a facilitator (facilitator mode): no gas of ours")
    if census.not_final:
        yield _note(
            f"not final yet: {census.not_final} settlement(s); a re-export may differ until final"
        )
    waiting = PaymentAttempt.objects.filter(
        rail="x402", state="succeeded", block_at__isnull=True, created_at__lt=period.end
    ).count()
    if waiting:
        yield _note(
            f"awaiting the chain: {waiting} settled payment(s) without their block's time yet, "
            "in no period until it is read"
        )


def _note(text: str) -> dict[str, str]:
    return {"record": "note", "note": text}


DEPOSIT_NOTE = "prepaid top-up: held, owed to the buyer; earned as consumed (prepaid rows)"


def _line_row(line: BookLine, include_self_payments: bool) -> dict[str, str]:
    totals = Totals()
    totals.add(line, include_self_payments=include_self_payments)
    note = line.gas_note
    if line.self_payment:
        note = "; ".join(filter(None, ["from the seller's own wallet", note]))
    if not line.is_final:
        note = "; ".join(filter(None, [note, "not final yet"]))
    if line.record == "deposit":
        note = "; ".join(filter(None, [DEPOSIT_NOTE, note]))
    return {
        "record": line.record,
        "time_utc": utc_text(line.at),
        "offering": line.offering,
        "purchase": line.purchase,
        "rail": line.rail,
        "network": line.network,
        "asset_symbol": line.symbol,
        "asset": line.asset,
        "payer": line.payer,
        "transaction": line.transaction,
        "block": "" if line.block is None else str(line.block),
        "self_payment": "yes" if line.self_payment else "no",
        **_amounts(totals, line.decimals, line.network, with_gas=line.gas_symbol_shown),
        "gas": "" if line.gas_wei is None else units(line.gas_wei, NATIVE_DECIMALS),
        "note": note,
    }


def _amounts(totals: Totals, decimals: int, network: str, *, with_gas: bool) -> dict[str, str]:
    return {
        "revenue": units(totals.revenue, decimals),
        "refunds": units(totals.refunds, decimals),
        "credits": units(totals.credits, decimals),
        "excluded": units(totals.excluded, decimals),
        "net": units(totals.net, decimals),
        "gas": units(totals.gas_wei, NATIVE_DECIMALS) if with_gas else "",
        "gas_symbol": native_symbol(network) if with_gas else "",
    }


def _total_rows(
    by_offering: dict[tuple[Any, ...], Totals], by_unit: dict[tuple[Any, ...], Totals]
) -> Iterable[dict[str, str]]:
    for (offering, network, asset, symbol, decimals), totals in by_offering.items():
        yield {"record": "offering_total", "offering": offering, "network": network,
               "asset_symbol": symbol, "asset": asset,
               **_amounts(totals, decimals, network, with_gas=True)}  # fmt: skip
    for (network, asset, symbol, decimals), totals in by_unit.items():
        yield {"record": "total", "network": network, "asset_symbol": symbol, "asset": asset,
               **_amounts(totals, decimals, network, with_gas=True)}  # fmt: skip


def _prepaid_rows(period: Period) -> Iterable[dict[str, str]]:
    named = {o.asset: o for o in Offering.objects.order_by("-pk")}  # the oldest offering wins
    for asset, moves in prepaid_movements(period=period).items():
        offering = named.get(asset)
        symbol = offering.asset_symbol if offering else ""
        decimals = offering.asset_decimals if offering else 0
        for record, amount, note in moves:
            held = units(amount, decimals) if offering else f"{amount} (smallest unit)"
            yield {"record": record, "rail": "prepaid", "asset_symbol": symbol,
                   "asset": asset, "held": held, "note": note}  # fmt: skip
