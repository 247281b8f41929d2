"""The `report` executor: per-column statistics of a CSV, computed in-process.

Synchronous: `start` returns the finished output together with the job ref.

Recovery contract. The computation is pure and deterministic (Decimal arithmetic, sorted
keys, no clock, no randomness): the same input gives byte-identical output, so the result's
SHA-256 is stable. The output is never stored here, so `fetch` raises
`ExecutorError("not_fetchable", definitive=True)`. A caller that lost the output of `start`
(crash before saving it) recovers by calling `start` again with the same `JobSpec`, which
costs nothing extra and yields the same bytes; it must not read `not_fetchable` as "the
work failed".
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from collections import Counter
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Context, Decimal
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from fulfillment.executors.base import ExecutorError, JobOutput, JobSpec, JobStatus, Started

MAX_CSV_CHARS = 1_000_000
# Numbers longer than this are treated as text. Together with MAX_CSV_CHARS it bounds every
# exact intermediate (sums, sums of squares) far below _EXACT.prec, so those never round.
MAX_NUMBER_DIGITS = 30
TOP_VALUES = 3
REPORT_VERSION = 1

REPORT_INPUT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "Report input",
    "description": (
        "Per-column statistics of a CSV. Numeric columns: count, missing, sum, min, max, mean, "
        "median, stdev (sample; null below 2 values). Text columns: count, missing, distinct, "
        "top 3 values. A column is numeric when every non-blank cell is a plain decimal "
        "(e.g. -12.50; no exponent, no thousands separator, at most 30 digits). Decimal "
        "values are strings; mean and stdev are rounded half-even to 6 decimal places."
    ),
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 200},
        "csv": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_CSV_CHARS,
            "description": "CSV text, comma separated; the first row is the header.",
        },
        "format": {
            "enum": ["json", "csv"],
            "default": "json",
            "description": "json (application/json) or csv (rows of column,statistic,value).",
        },
    },
    "required": ["title", "csv"],
    "additionalProperties": False,
    # What discovery shows as the example input (x402 bazaar `body`).
    "examples": [{"title": "Sales", "csv": "region,units\nnorth,3\nsouth,5\n"}],
}

_VALIDATOR = Draft202012Validator(REPORT_INPUT_SCHEMA)
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_SIX_PLACES = Decimal("0.000001")
# Exact arithmetic: wide enough that no sum or product of bounded inputs is ever rounded.
_EXACT = Context(prec=250, rounding=ROUND_HALF_EVEN)
_REF_PREFIX = "report_"


@dataclass(frozen=True)
class _Table:
    header: list[str]
    rows: list[list[str]]


class ReportExecutor:
    name = "report"
    finishes_in_start = True

    def start(self, job: JobSpec) -> Started:
        title, text, fmt = _validated_input(job.input)
        table = _parse_csv(text)
        columns = [
            _column_stats(name, [row[i] for row in table.rows])
            for i, name in enumerate(table.header)
        ]
        report = {
            "version": REPORT_VERSION,
            "title": title,
            "row_count": len(table.rows),
            "column_count": len(table.header),
            "columns": columns,
        }
        output = _render_csv(report) if fmt == "csv" else _render_json(report)
        return Started(job_ref=job_ref_for(job.idempotency_key), output=output)

    def poll(self, job_ref: str) -> JobStatus:
        # Our refs only exist once the work is done; a foreign ref is not ours to judge.
        return JobStatus.SUCCEEDED if job_ref.startswith(_REF_PREFIX) else JobStatus.UNKNOWN

    def fetch(self, job_ref: str) -> JobOutput:
        raise ExecutorError(
            "not_fetchable",
            "report output is returned by start(); call start() again with the same job",
            definitive=True,
        )


def job_ref_for(idempotency_key: str) -> str:
    return _REF_PREFIX + hashlib.sha256(idempotency_key.encode()).hexdigest()[:32]


def _invalid(message: str) -> ExecutorError:
    return ExecutorError("invalid_report_input", message, definitive=True)


def _validated_input(data: Any) -> tuple[str, str, str]:
    error = best_match(_VALIDATOR.iter_errors(data))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "input"
        raise _invalid(f"{where}: {error.message}")
    return data["title"], data["csv"], data.get("format", "json")


def _parse_csv(text: str) -> _Table:
    try:
        raw = list(csv.reader(io.StringIO(text.removeprefix("\ufeff")), strict=True))
    except csv.Error as exc:
        raise _invalid(f"malformed CSV: {exc}") from exc
    rows = [row for row in raw if row]  # csv yields [] for blank lines
    if not rows:
        raise _invalid("CSV is empty")
    header = [name.strip() for name in rows[0]]
    if any(not name for name in header):
        raise _invalid("CSV header has a blank column name")
    if len(set(header)) != len(header):
        raise _invalid("CSV header has duplicate column names")
    body = rows[1:]
    if not body:
        raise _invalid("CSV has a header but no data rows")
    for number, row in enumerate(body, start=2):
        if len(row) != len(header):
            raise _invalid(f"row {number} has {len(row)} fields, header has {len(header)}")
    return _Table(header=header, rows=[[cell.strip() for cell in row] for row in body])


def _as_number(cell: str) -> Decimal | None:
    if not _NUMBER.fullmatch(cell) or sum(ch.isdigit() for ch in cell) > MAX_NUMBER_DIGITS:
        return None
    return Decimal(cell)


def _column_stats(name: str, cells: list[str]) -> dict[str, Any]:
    present = [cell for cell in cells if cell]
    base: dict[str, Any] = {
        "name": name,
        "count": len(present),
        "missing": len(cells) - len(present),
    }
    numbers = [_as_number(cell) for cell in present]
    if present and all(n is not None for n in numbers):
        return {**base, "type": "numeric", **_numeric_stats([n for n in numbers if n is not None])}
    counts = Counter(present)
    top = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:TOP_VALUES]
    return {
        **base,
        "type": "text",
        "distinct": len(counts),
        "top": [{"value": value, "count": count} for value, count in top],
    }


def _numeric_stats(values: list[Decimal]) -> dict[str, str | None]:
    n = len(values)
    total = _exact_sum(values)
    ordered = sorted(values)
    mean = _EXACT.quantize(_EXACT.divide(total, n), _SIX_PLACES)
    return {
        "sum": _fmt(total),
        "min": _fmt(ordered[0]),
        "max": _fmt(ordered[-1]),
        "mean": _fmt(mean),
        "median": _fmt(_median(ordered)),
        "stdev": _sample_stdev(values, total),
    }


def _median(ordered: list[Decimal]) -> Decimal:
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return _EXACT.divide(_EXACT.add(ordered[middle - 1], ordered[middle]), 2)


def _sample_stdev(values: list[Decimal], total: Decimal) -> str | None:
    n = len(values)
    if n < 2:
        return None
    squares = _exact_sum([_EXACT.multiply(v, v) for v in values])
    # n*sum(x^2) - sum(x)^2 is exact; only the division and the square root round.
    spread = _EXACT.subtract(_EXACT.multiply(n, squares), _EXACT.multiply(total, total))
    variance = _EXACT.divide(spread, n * (n - 1))
    return _fmt(_EXACT.quantize(_EXACT.sqrt(variance), _SIX_PLACES))


def _exact_sum(values: list[Decimal]) -> Decimal:
    total = Decimal(0)
    for value in values:
        total = _EXACT.add(total, value)
    return total


def _fmt(value: Decimal) -> str:
    # Fixed-point text: never exponent notation, so equal inputs print identically.
    return format(value, "f")


def _render_json(report: dict[str, Any]) -> JobOutput:
    text = json.dumps(report, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return JobOutput(content=text.encode("utf-8"), content_type="application/json")


def _render_csv(report: dict[str, Any]) -> JobOutput:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["column", "statistic", "value"])
    writer.writerow(["", "title", report["title"]])
    writer.writerow(["", "row_count", report["row_count"]])
    for column in report["columns"]:
        for key in sorted(column):
            if key == "top":
                for rank, item in enumerate(column["top"], start=1):
                    writer.writerow([column["name"], f"top_{rank}", item["value"]])
                    writer.writerow([column["name"], f"top_{rank}_count", item["count"]])
            elif key != "name":
                value = column[key]
                writer.writerow([column["name"], key, "" if value is None else value])
    return JobOutput(
        content=buffer.getvalue().encode("utf-8"), content_type="text/csv; charset=utf-8"
    )
