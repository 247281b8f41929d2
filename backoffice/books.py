"""The books: what a period earned, paid back and spent on gas, read from the record.

A sale is a settled payment, timed by its settling block's timestamp (UTC; a prepaid
purchase by its debit); an x402 top-up's settlement is a deposit, not revenue (it is earned
as the balance is spent, a prepaid sale); a refund paid back on chain and a credit to a
prepaid balance are timed by when they were paid. Amounts stay integers of the smallest
unit here; they become decimals (the asset's decimals, never a float) only when written
(backoffice.books_export).
A payment from one of the seller's own wallets is flagged: it moves the seller's money from
one pocket to another and is no revenue. Reads only: the export service records the file.
"""

from __future__ import annotations

import calendar
import heapq
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import (
    BooleanField,
    CharField,
    DecimalField,
    Exists,
    ExpressionWrapper,
    F,
    OuterRef,
    Q,
    QuerySet,
    Sum,
    Value,
)
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast, Coalesce, Collate, Lower, TruncDate

from fulfillment.executors.top_up import TOP_UP_EXECUTOR
from payments.models import LedgerEntry, PaymentAttempt, Rail, Refund, RelayerAccount
from payments.signers import relayer_address
from purchases.selectors import seller_wallets


class PeriodInvalid(ValueError):
    """A period that cannot be exported: malformed, empty, or not closed yet."""


@dataclass(frozen=True)
class Period:
    """[start, end) in UTC."""

    start: datetime
    end: datetime

    @classmethod
    def month(cls, text: str) -> Period:
        """ "2026-11": the whole UTC month. Raises PeriodInvalid."""
        try:
            year, month = (int(part) for part in text.split("-"))
            first = date(year, month, 1)
        except ValueError as exc:
            raise PeriodInvalid(f"a month is YYYY-MM, not {text!r}") from exc
        last = first.replace(day=calendar.monthrange(year, month)[1])
        return cls.days(first, last)

    @classmethod
    def days(cls, first: date, last: date) -> Period:
        """From the start of `first` to the end of `last` (both days included), UTC."""
        if last < first:
            raise PeriodInvalid(f"the period ends ({last}) before it starts ({first})")
        start = datetime.combine(first, time.min, tzinfo=UTC)
        try:
            after = last + timedelta(days=1)
        except OverflowError as exc:  # 9999-12-31: no day after it
            raise PeriodInvalid(f"no period ends after {last}") from exc
        return cls(start, datetime.combine(after, time.min, tzinfo=UTC))

    def check_closed(self, *, now: datetime) -> None:
        """Raises PeriodInvalid for an empty period or one still open: its books may change."""
        if self.end <= self.start:
            raise PeriodInvalid("the period is empty")
        if self.end > now:
            raise PeriodInvalid(
                f"the period is not closed: it ends {utc_text(self.end)}, after now "
                f"({utc_text(now)}); export it once it has ended"
            )

    @property
    def slug(self) -> str:
        last = self.end - timedelta(microseconds=1)
        return f"{self.start:%Y%m%dT%H%M%S}-{last:%Y%m%dT%H%M%S}"


def utc_text(value: datetime) -> str:
    """ISO 8601 in UTC to the second, with a Z: one spelling in every file."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class BookLine:
    """One sale, refund or credit, in the smallest unit of its asset."""

    # "sale", "deposit" (an x402 top-up's settlement: held for the buyer, earned only when the
    # balance is spent), "refund" (paid back on chain) or "credit" (to a prepaid balance)
    record: str
    at: datetime
    offering: str
    purchase: str
    rail: str
    network: str
    asset: str
    symbol: str
    decimals: int
    payer: str
    transaction: str
    block: int | None
    self_payment: bool
    amount: int
    # Wei the relayer paid for this settlement; None when none of ours (a facilitator's gas,
    # a prepaid sale, or a receipt not read yet: `gas_note` says which).
    gas_wei: int | None
    gas_note: str
    is_final: bool
    pk: int

    @property
    def gas_symbol_shown(self) -> bool:
        """A chain sale (ours, or none in facilitator mode), or a payback whose gas a seller
        wallet paid: the gas column speaks of it."""
        if self.record == "refund":
            return self.gas_wei is not None
        return self.record in ("sale", "deposit") and self.rail == Rail.X402

    @property
    def sort_key(self) -> tuple[Any, ...]:
        return (self.at, RECORD_ORDER[self.record], self.purchase, self.transaction, self.pk)


# Rows per round trip of the server-side cursor.
EXPORT_CHUNK_ROWS = 5000
# A deposit is read with the sales (one stream, one order): it sorts as one.
RECORD_ORDER = {"sale": 0, "deposit": 0, "refund": 1, "credit": 2}
FACILITATOR_GAS = "gas paid by the facilitator (facilitator mode): none of ours"
PAYBACK_GAS_SHARED = "gas of this transaction counted once, on its first refund"


NATIVE_DECIMALS = 18  # every EVM network we settle on counts its coin in wei


def native_symbol(network: str) -> str:
    """The network's native coin (gas), "ETH" unless its settings name another."""
    return str(settings.X402_NETWORKS.get(network, {}).get("native_symbol", "ETH"))


def relayer_addresses() -> dict[str, set[str]]:
    """Our relayer accounts per network, lower-case: the rows the relayer keeps and the
    key configured now (a network that never broadcast has no row yet)."""
    found: dict[str, set[str]] = defaultdict(set)
    for network, address in RelayerAccount.objects.values_list("network", "address"):
        found[network].add(address.lower())
    for network in settings.X402_NETWORKS:
        relayer = relayer_address(network=network)
        if relayer:
            found[network].add(relayer.lower())
    return found


# One time column per row ("at"): decoding a timestamp with its zone is the dearest part of
# reading a row, a third of the export's time with three of them.
_SALE_FIELDS = (
    "pk", "rail", "network", "asset", "payer", "amount", "tx_hash", "block_number",
    "at", "gas_used", "effective_gas_price", "sent_by", "is_final",
    "purchase__ref", "purchase__offering__slug", "purchase__offering__asset_symbol",
    "purchase__offering__asset_decimals", "purchase__offering__executor",
)  # fmt: skip
_REFUND_FIELDS = (
    "pk", "method", "network", "asset", "payer", "amount", "paid_reference", "paid_at",
    "purchase__ref", "purchase__offering__slug", "purchase__offering__asset_symbol",
    "purchase__offering__asset_decimals", "payback_evidence", "gas_carrier",
)  # fmt: skip


class _Bytewise(Collate):
    """Ordered by code point, as Python compares strings (the merge below needs both orders
    to agree): PostgreSQL's "C" collation (the database's default may not be), SQLite's
    BINARY (its bytes compare as UTF-8, so by code point; SQLite has no "C")."""

    def __init__(self, expression: Any) -> None:
        super().__init__(expression, "C")

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return super().as_sql(compiler, connection, collation="BINARY", **extra)


def _bytewise(expression: Any) -> Collate:
    return _Bytewise(expression)


def _in_file_order(rows: QuerySet[Any], tx_field: str) -> QuerySet[Any]:
    """Rows ordered as BookLine.sort_key orders their lines (within one record kind)."""
    return rows.order_by(
        F("at").asc(), _bytewise("purchase__ref").asc(), _bytewise(tx_field).asc(), "pk"
    )


def book_lines_stream(*, period: Period) -> Iterator[BookLine]:
    """Every sale, refund and credit of the period, in file order, a chunk of rows at a time:
    each kind is read in the file's order by the database and the three are merged, so
    memory stays flat however long the period. Open a transaction around it (PostgreSQL
    then streams its server-side cursors instead of filling them first)."""
    ours, wallets = relayer_addresses(), seller_wallets()
    settled = PaymentAttempt.objects.filter(state=PaymentAttempt.State.SUCCEEDED)
    chain = settled.filter(rail=Rail.X402, block_at__gte=period.start, block_at__lt=period.end)
    prepaid = settled.filter(
        rail=Rail.PREPAID, created_at__gte=period.start, created_at__lt=period.end
    )
    final = ExpressionWrapper(Q(final_at__isnull=False), output_field=BooleanField())
    tx = Coalesce("tx_hash", Value(""))
    sales = [
        (_sale(row, ours, wallets) for row in _in_file_order(rows, "tx").values(*_SALE_FIELDS)
         .iterator(chunk_size=EXPORT_CHUNK_ROWS))
        for rows in (
            chain.annotate(at=F("block_at"), is_final=final, tx=tx),
            prepaid.annotate(at=F("created_at"), is_final=Value(True), tx=tx),
        )
    ]  # fmt: skip
    paid = Refund.objects.filter(
        state=Refund.State.PAID, paid_at__gte=period.start, paid_at__lt=period.end
    )
    refunds = _in_file_order(
        paid.annotate(at=F("paid_at"), gas_carrier=_gas_carrier()), "paid_reference"
    )
    rows = refunds.values(*_REFUND_FIELDS).iterator(chunk_size=EXPORT_CHUNK_ROWS)
    yield from heapq.merge(
        *sales, (_refund(row, wallets) for row in rows), key=lambda line: line.sort_key
    )


def _gas_carrier() -> Any:
    """A transaction paying several refunds back (a Safe batch) paid its gas once: it is
    counted on the refund of its first transfer log."""
    earlier_in_tx = Refund.objects.filter(
        state=Refund.State.PAID,
        network=OuterRef("network"),
        paid_reference=OuterRef("paid_reference"),
        payback_log_index__lt=OuterRef("payback_log_index"),
    )
    return ~Exists(earlier_in_tx)


def book_lines(*, period: Period) -> list[BookLine]:
    """Every sale, refund and credit of the period, in file order (all in memory)."""
    with transaction.atomic():
        return list(book_lines_stream(period=period))


def _sale(row: dict[str, Any], ours: dict[str, set[str]], wallets: set[str]) -> BookLine:
    is_chain = row["rail"] == Rail.X402
    gas_wei, gas_note = None, ""
    if is_chain and row["sent_by"] and row["sent_by"] in ours.get(row["network"], ()):
        gas_wei = int(row["gas_used"]) * int(row["effective_gas_price"])
    elif is_chain and row["sent_by"]:
        gas_note = FACILITATOR_GAS
    is_deposit = row["purchase__offering__executor"] == TOP_UP_EXECUTOR
    return BookLine(
        record="deposit" if is_deposit else "sale",
        at=row["at"],
        offering=row["purchase__offering__slug"],
        purchase=row["purchase__ref"],
        rail=row["rail"],
        network=row["network"],
        asset=row["asset"],
        symbol=row["purchase__offering__asset_symbol"],
        decimals=row["purchase__offering__asset_decimals"],
        payer=row["payer"],
        transaction=row["tx_hash"] or "",
        block=row["block_number"],
        self_payment=row["payer"].lower() in wallets,
        amount=row["amount"],
        gas_wei=gas_wei,
        gas_note=gas_note,
        is_final=row["is_final"],
        pk=row["pk"],
    )


@dataclass(frozen=True)
class PeriodCensus:
    """What the export's notes say of a whole period, counted by the database (the notes
    come before the lines, which are streamed)."""

    self_payments: int
    facilitated_networks: list[str]
    not_final: int


def period_census(*, period: Period) -> PeriodCensus:
    """The same tests as the lines' (_sale), as queries."""
    ours, wallets = relayer_addresses(), sorted(seller_wallets())
    settled = PaymentAttempt.objects.filter(state=PaymentAttempt.State.SUCCEEDED)
    chain = settled.filter(rail=Rail.X402, block_at__gte=period.start, block_at__lt=period.end)
    prepaid = settled.filter(
        rail=Rail.PREPAID, created_at__gte=period.start, created_at__lt=period.end
    )
    selfs = sum(
        rows.annotate(wallet=Lower("payer")).filter(wallet__in=wallets).count()
        for rows in (chain, prepaid)
    )
    sent = chain.exclude(sent_by__isnull=True).exclude(sent_by="")
    facilitated = [
        network
        for network in sorted(set(sent.values_list("network", flat=True).distinct()))
        if sent.filter(network=network).exclude(sent_by__in=sorted(ours.get(network, ()))).exists()
    ]
    return PeriodCensus(selfs, facilitated, chain.filter(final_at__isnull=True).count())


def _payback_gas(row: dict[str, Any], wallets: set[str]) -> tuple[int | None, str]:
    """The wei the seller paid to send this refund back: the transaction's gas when its
    sender (who pays gas; for a Safe batch, the executing owner) is a seller wallet we know,
    once per transaction. Read from the receipt kept when the payback was verified."""
    evidence = row["payback_evidence"] or {}
    if row["method"] != Refund.Method.PAY_BACK or "gas_used" not in evidence:
        return None, ""  # closed before gas was kept, or not on chain
    sender = str(evidence.get("tx_from", ""))
    if sender not in wallets:
        return None, f"gas paid by {sender}, not a seller wallet we know: not counted"
    if not row["gas_carrier"]:
        return None, PAYBACK_GAS_SHARED
    return int(evidence["gas_used"]) * int(evidence["effective_gas_price"]), ""


def _refund(row: dict[str, Any], wallets: set[str]) -> BookLine:
    gas_wei, gas_note = _payback_gas(row, wallets)
    return BookLine(
        record="refund" if row["method"] == Refund.Method.PAY_BACK else "credit",
        at=row["paid_at"],
        offering=row["purchase__offering__slug"],
        purchase=row["purchase__ref"],
        rail=Rail.X402 if row["method"] == Refund.Method.PAY_BACK else Rail.PREPAID,
        network=row["network"],
        asset=row["asset"],
        symbol=row["purchase__offering__asset_symbol"],
        decimals=row["purchase__offering__asset_decimals"],
        payer=row["payer"],
        transaction=row["paid_reference"],
        block=None,
        self_payment=False,
        amount=row["amount"],
        gas_wei=gas_wei,
        gas_note=gas_note,
        is_final=True,
        pk=row["pk"],
    )


@dataclass
class Totals:
    """Sums of lines, in the smallest unit (gas in wei)."""

    revenue: int = 0
    refunds: int = 0
    credits: int = 0
    excluded: int = 0
    gas_wei: int = 0

    @property
    def net(self) -> int:
        return self.revenue - self.refunds - self.credits

    def add(self, line: BookLine, *, include_self_payments: bool) -> None:
        if line.record == "refund":
            self.refunds += line.amount
        elif line.record == "deposit":
            pass  # no revenue: the prepaid rows count it (deposits), then what is consumed
        elif line.record == "credit":
            self.credits += line.amount
        elif line.self_payment and not include_self_payments:
            self.excluded += line.amount
        else:
            self.revenue += line.amount
        self.gas_wei += line.gas_wei or 0


PREPAID_MOVES = (
    ("prepaid_deposits", LedgerEntry.Kind.TOP_UP, "deposits: held, owed to buyers"),
    ("prepaid_consumed", LedgerEntry.Kind.PURCHASE_DEBIT, "consumed: earned (prepaid sales)"),
    ("prepaid_credits", LedgerEntry.Kind.REFUND_CREDIT, "refunds credited back: held again"),
    ("prepaid_adjustments", LedgerEntry.Kind.ADJUSTMENT, "adjustments"),
)


def prepaid_movements(*, period: Period) -> dict[str, list[tuple[str, int, str]]]:
    """Per asset: what buyers' prepaid balances held at the start, each kind of movement in
    the period (signed), and what they held at the end: (record, amount, note)."""
    entries = LedgerEntry.objects.all()
    before = _sums(entries.filter(created_at__lt=period.start), "asset")
    during = _sums(
        entries.filter(created_at__gte=period.start, created_at__lt=period.end), "asset", "kind"
    )
    assets = sorted({*before, *(asset for asset, _ in during)})
    found: dict[str, list[tuple[str, int, str]]] = {}
    for asset in assets:
        opening = before.get(asset, 0)
        moves = [
            (record, during.get((asset, kind), 0), note) for record, kind, note in PREPAID_MOVES
        ]
        closing = opening + sum(amount for _, amount, _ in moves)
        found[asset] = [
            ("prepaid_held_opening", opening, "held at the start: owed to buyers"),
            *moves,
            ("prepaid_held_closing", closing, "held at the end: owed to buyers"),
        ]
    return found


def _sums(entries: Any, *keys: str) -> dict[Any, int]:
    rows = entries.values(*keys).annotate(total=Sum("amount")).order_by(*keys)
    return {
        (row[keys[0]] if len(keys) == 1 else tuple(row[k] for k in keys)): int(row["total"])
        for row in rows
    }


@dataclass(frozen=True)
class BooksDay:
    day: date
    # Per asset symbol, in asset units: revenue (self-payments excluded) and money returned
    # (refunds paid back and credits); per native coin symbol, the relayer's gas.
    revenue: dict[str, Decimal]
    refunds: dict[str, Decimal]
    gas: dict[str, Decimal]


def books_daily(*, now: datetime, days: int = 14) -> list[BooksDay]:
    """The last `days` UTC days up to today's: revenue, refunds and gas per day (the
    dashboard's chart). Summed by the database per day, whatever the volume; read from the
    record only (no chain look-up on a page view)."""
    first = now.astimezone(UTC).date() - timedelta(days=days - 1)
    period = Period.days(first, first + timedelta(days=days - 1))
    found = {first + timedelta(days=i): BooksDay(first + timedelta(days=i), {}, {}, {})
             for i in range(days)}  # fmt: skip
    ours, wallets = relayer_addresses(), sorted(seller_wallets())
    settled = PaymentAttempt.objects.filter(state=PaymentAttempt.State.SUCCEEDED)
    chain = settled.filter(rail=Rail.X402, block_at__gte=period.start, block_at__lt=period.end)
    prepaid = settled.filter(
        rail=Rail.PREPAID, created_at__gte=period.start, created_at__lt=period.end
    )
    # A top-up's settlement is a deposit: earned when the balance is spent (the prepaid sales).
    deposits = Q(purchase__offering__executor=TOP_UP_EXECUTOR)
    sales = [(chain.exclude(deposits), "block_at"), (prepaid, "created_at")]
    for rows, when in sales:
        bought = rows.annotate(wallet=Lower("payer")).exclude(wallet__in=wallets)
        _add_daily(found, "revenue", _per_day(bought, when, "amount"))
    paid = Refund.objects.filter(
        state=Refund.State.PAID, paid_at__gte=period.start, paid_at__lt=period.end
    )
    _add_daily(found, "refunds", _per_day(paid, "paid_at", "amount"))
    for network, addresses in sorted(ours.items()):
        spent = chain.filter(network=network, sent_by__in=sorted(addresses)).annotate(
            wei=F("gas_used") * F("effective_gas_price")
        )
        for day, total in _sums_per_day(spent, "block_at", "wei"):
            _add_gas(found, day, network, total)
    for day, network, total in _payback_gas_per_day(paid, set(wallets)):
        _add_gas(found, day, network, total)
    return list(found.values())


def _add_gas(found: dict[date, BooksDay], day: date, network: str, wei: int) -> None:
    coin = native_symbol(network)
    gas = Decimal(wei).scaleb(-NATIVE_DECIMALS)
    found[day].gas[coin] = found[day].gas.get(coin, Decimal(0)) + gas


def _payback_gas_per_day(paid: QuerySet[Refund], wallets: set[str]) -> list[tuple[date, str, int]]:
    """(day, network, wei) the seller's wallets paid to send refunds back, each transaction
    once (as the export counts it), from the receipts kept when each payback was verified."""
    wei = DecimalField(max_digits=40, decimal_places=0)
    rows = (
        paid.filter(method=Refund.Method.PAY_BACK, payback_evidence__has_key="gas_used")
        .annotate(
            # Cast: a key's text compared as text, not as JSON (on SQLite `__in` on the key
            # itself reads each listed address as a JSON document: "malformed JSON").
            tx_from=Cast(KeyTextTransform("tx_from", "payback_evidence"), CharField()),
            wei=Cast(KeyTextTransform("gas_used", "payback_evidence"), wei)
            * Cast(KeyTextTransform("effective_gas_price", "payback_evidence"), wei),
            gas_carrier=_gas_carrier(),
        )
        .filter(tx_from__in=sorted(wallets), gas_carrier=True)
        .annotate(day=TruncDate("paid_at", tzinfo=UTC))
        .values("day", "network")
        .annotate(total=Sum("wei"))
        .order_by()
    )
    return [(row["day"], row["network"], int(row["total"] or 0)) for row in rows]


def _per_day(rows: Any, when: str, amount: str) -> list[tuple[date, str, Decimal]]:
    """(day, asset symbol, sum in asset units) of `rows`, by the offering's asset."""
    grouped = (
        rows.annotate(day=TruncDate(when, tzinfo=UTC))
        .values("day", "purchase__offering__asset_symbol", "purchase__offering__asset_decimals")
        .annotate(total=Sum(amount))
        .order_by()
    )
    return [
        (row["day"], row["purchase__offering__asset_symbol"],
         Decimal(int(row["total"])).scaleb(-row["purchase__offering__asset_decimals"]))
        for row in grouped
    ]  # fmt: skip


def _sums_per_day(rows: Any, when: str, amount: str) -> list[tuple[date, int]]:
    grouped = (
        rows.annotate(day=TruncDate(when, tzinfo=UTC))
        .values("day")
        .annotate(total=Sum(amount))
        .order_by()
    )
    return [(row["day"], int(row["total"] or 0)) for row in grouped]


def _add_daily(
    found: dict[date, BooksDay], series: str, sums: list[tuple[date, str, Decimal]]
) -> None:
    for day, symbol, value in sums:
        figures = getattr(found[day], series)
        figures[symbol] = figures.get(symbol, Decimal(0)) + value
