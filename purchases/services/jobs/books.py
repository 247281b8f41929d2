"""The revenue export of a closed period: one CSV, recorded with its SHA-256.

The file is a function of the record alone: rows in a fixed order, amounts as exact decimals
with the asset's symbol, times in UTC to the second, and no generation time inside. So a
re-export of a closed period is byte-identical, and its batch shows the same SHA-256 (as the
refund CSV's). What makes a period's file change is said in its notes lines: settlements not
final yet, and settlements whose block time the chain has not told us yet.

Rows (`record`): a note; a `sale` (settled payment), `refund` (paid back on chain) or
`credit` (credited to a prepaid balance); an `offering_total` per offering and asset and a
`total` per asset; and the prepaid balances per asset (held at the start, deposits,
consumption, credits, adjustments, held at the end).
"""

from __future__ import annotations

import csv
import hashlib
import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from core.clock import now_or
from payments.models import ExportBatch, PaymentAttempt
from payments.services import export_batch_record
from payments.x402.books_evidence import (
    settlement_books_evidence_fill,
    settlements_awaiting_block_time,
)
from purchases.books import (
    FACILITATOR_GAS,
    NATIVE_DECIMALS,
    BookLine,
    Period,
    Totals,
    book_lines,
    native_symbol,
    prepaid_movements,
    totals_by,
    utc_text,
)
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


def books_export(
    *,
    period: Period,
    created_by: str,
    include_self_payments: bool = False,
    now: datetime | None = None,
) -> BooksExport:
    """Write the period's books as CSV and record the batch.

    Settled payments still without their block's time are looked up on chain first (no
    transaction open); those the chain does not answer for are counted in a note. Raises
    PeriodInvalid (a ValueError) for a period that is not closed yet.
    """
    now = now_or(now)
    period.check_closed(now=now)
    settlement_books_evidence_fill(
        attempts=list(settlements_awaiting_block_time(created_before=period.end))
    )
    content, row_count, first_at, last_at = books_csv(
        period=period, include_self_payments=include_self_payments
    )
    digest = hashlib.sha256(content).hexdigest()
    batch = export_batch_record(
        kind="books",
        created_by=created_by,
        filters={
            "period_start": utc_text(period.start),
            "period_end": utc_text(period.end),
            "include_self_payments": include_self_payments,
        },
        row_count=row_count,
        sha256=digest,
        started_at=now,
        first_created_at=first_at,
        last_created_at=last_at,
    )
    return BooksExport(content, digest, row_count, batch)


def books_csv(
    *, period: Period, include_self_payments: bool
) -> tuple[bytes, int, datetime | None, datetime | None]:
    """(the file, its data rows, the first and last line's time)."""
    lines = book_lines(period=period)
    rows = [
        *_notes(period, lines, include_self_payments),
        *(_line_row(line, include_self_payments) for line in lines),
        *_total_rows(lines, include_self_payments),
        *_prepaid_rows(period),
    ]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(BOOKS_CSV_COLUMNS)
    writer.writerows([row.get(column, "") for column in BOOKS_CSV_COLUMNS] for row in rows)
    first = lines[0].at if lines else None
    last = lines[-1].at if lines else None
    return out.getvalue().encode(), len(rows), first, last


def _notes(
    period: Period, lines: list[BookLine], include_self_payments: bool
) -> Iterator[dict[str, str]]:
    yield _note(
        f"period {utc_text(period.start)} to {utc_text(period.end)} (UTC, end excluded); "
        "a sale is timed by its settling block's timestamp (prepaid: the debit), a refund "
        "or credit by when it was paid"
    )
    yield _note(
        "amounts in asset units, exact (smallest unit over the asset's decimals); gas is "
        "what our relayer paid per settlement (gasUsed x effectiveGasPrice), in the "
        "network's native coin, not converted; net = revenue - refunds - credits, before gas"
    )
    selfs = [line for line in lines if line.self_payment]
    treated = "included in revenue (asked)" if include_self_payments else "excluded from revenue"
    yield _note(f"payments from the seller's own wallets: {len(selfs)}, {treated}")
    for network in sorted({line.network for line in lines if line.gas_note == FACILITATOR_GAS}):
        yield _note(f"{network}: settled by a facilitator (facilitator mode): no gas of ours")
    unfinal = sum(1 for line in lines if not line.is_final)
    if unfinal:
        yield _note(f"not final yet: {unfinal} settlement(s); a re-export may differ until final")
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


def _line_row(line: BookLine, include_self_payments: bool) -> dict[str, str]:
    totals = Totals()
    totals.add(line, include_self_payments=include_self_payments)
    note = line.gas_note
    if line.self_payment:
        note = "; ".join(filter(None, ["from the seller's own wallet", note]))
    if not line.is_final:
        note = "; ".join(filter(None, [note, "not final yet"]))
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


def _total_rows(lines: list[BookLine], include_self_payments: bool) -> Iterable[dict[str, str]]:
    def unit(line: BookLine) -> tuple[str, str, str, int]:
        return (line.network, line.asset, line.symbol, line.decimals)

    by_offering = totals_by(
        lines,
        lambda line: (line.offering, *unit(line)),
        include_self_payments=include_self_payments,
    )
    for (offering, network, asset, symbol, decimals), totals in by_offering.items():
        yield {"record": "offering_total", "offering": offering, "network": network,
               "asset_symbol": symbol, "asset": asset,
               **_amounts(totals, decimals, network, with_gas=True)}  # fmt: skip
    for (network, asset, symbol, decimals), totals in totals_by(
        lines, unit, include_self_payments=include_self_payments
    ).items():
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
