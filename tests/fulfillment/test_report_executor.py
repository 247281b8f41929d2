"""The report executor: exact Decimal statistics, byte-stable output, definitive rejections."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from fulfillment.executors import ExecutorError, JobSpec, JobStatus, get_executor
from fulfillment.executors.report import REPORT_INPUT_SCHEMA, ReportExecutor, job_ref_for

SALES_CSV = "region,units,price\nnorth,3,0.1\nsouth,5,0.2\nnorth,4,\n"


def job(data: Any, key: str = "exec-pur_1") -> JobSpec:
    return JobSpec(purchase_ref="pur_1", operation="report", input=data, idempotency_key=key)


def report(csv_text: str, **extra: Any) -> dict[str, Any]:
    started = ReportExecutor().start(job({"title": "Sales", "csv": csv_text, **extra}))
    assert started.output is not None
    assert started.output.content_type == "application/json"
    result: dict[str, Any] = json.loads(started.output.content)
    return result


def column(result: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in result["columns"] if c["name"] == name)
    return found


def test_statistics_of_a_small_csv_are_exact() -> None:
    result = report(SALES_CSV)

    assert result["title"] == "Sales"
    assert (result["row_count"], result["column_count"]) == (3, 3)
    assert [c["name"] for c in result["columns"]] == ["region", "units", "price"]
    assert column(result, "region") == {
        "name": "region",
        "type": "text",
        "count": 3,
        "missing": 0,
        "distinct": 2,
        "top": [{"value": "north", "count": 2}, {"value": "south", "count": 1}],
    }
    assert column(result, "units") == {
        "name": "units",
        "type": "numeric",
        "count": 3,
        "missing": 0,
        "sum": "12",
        "min": "3",
        "max": "5",
        "mean": "4.000000",
        "median": "4",
        "stdev": "1.000000",
    }
    # A blank cell is missing, not zero; sample stdev of (0.1, 0.2) is 0.0707106...
    assert column(result, "price") == {
        "name": "price",
        "type": "numeric",
        "count": 2,
        "missing": 1,
        "sum": "0.3",
        "min": "0.1",
        "max": "0.2",
        "mean": "0.150000",
        "median": "0.15",
        "stdev": "0.070711",
    }


def test_decimal_arithmetic_never_goes_through_float() -> None:
    assert column(report("x\n0.1\n0.2\n"), "x")["sum"] == "0.3"  # float: 0.30000000000000004
    big = column(report("x\n12345678901234567890.123456789\n0.000000001\n"), "x")
    assert big["sum"] == "12345678901234567890.123456790"
    assert big["median"] == "6172839450617283945.061728395"
    thirds = column(report("x\n1\n2\n2\n"), "x")
    assert (thirds["mean"], thirds["stdev"]) == ("1.666667", "0.577350")


def test_edge_columns() -> None:
    result = report("one,flat,mixed,tag\n7,2.5,1,b\n,2.50,1e5,a\n,2.5,3,a\n")
    assert column(result, "one")["stdev"] is None  # a single value has no sample stdev
    assert column(result, "one")["missing"] == 2
    assert column(result, "flat")["stdev"] == "0.000000"
    assert column(result, "mixed")["type"] == "text"  # exponents are not plain decimals
    assert column(result, "tag")["top"] == [{"value": "a", "count": 2}, {"value": "b", "count": 1}]
    too_long = "9" * 31
    assert column(report(f"n\n{too_long}\n"), "n")["type"] == "text"


def test_output_is_byte_identical_across_runs() -> None:
    data = {"title": "Sales", "csv": SALES_CSV}
    first = ReportExecutor().start(job(data))
    second = ReportExecutor().start(job(dict(data)))
    assert first.output is not None and second.output is not None
    assert first.output.content == second.output.content
    assert first.job_ref == second.job_ref == job_ref_for("exec-pur_1")
    assert ReportExecutor().start(job(data, key="exec-pur_2")).job_ref != first.job_ref
    # Pinned bytes: any change to the output format changes every stored result's hash.
    tiny = ReportExecutor().start(job({"title": "T", "csv": "n\n1\n"}))
    assert tiny.output is not None
    assert tiny.output.content == (
        b'{"column_count":1,"columns":[{"count":1,"max":"1","mean":"1.000000","median":"1",'
        b'"min":"1","missing":0,"name":"n","stdev":null,"sum":"1","type":"numeric"}],'
        b'"row_count":1,"title":"T","version":1}'
    )


def test_csv_format() -> None:
    started = ReportExecutor().start(job({"title": "Sales", "csv": SALES_CSV, "format": "csv"}))
    assert started.output is not None
    assert started.output.content_type == "text/csv; charset=utf-8"
    rows = list(csv.reader(io.StringIO(started.output.content.decode())))
    assert rows[:3] == [
        ["column", "statistic", "value"],
        ["", "title", "Sales"],
        ["", "row_count", "3"],
    ]
    assert ["price", "sum", "0.3"] in rows
    assert ["region", "top_1", "north"] in rows
    assert ["region", "top_1_count", "2"] in rows


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"title": "T"}, "'csv' is a required property"),
        ({"title": "T", "csv": ""}, "csv"),
        ({"title": "T", "csv": "a\n", "format": "xml"}, "format"),
        ({"title": "T", "csv": "a\n1\n", "extra": 1}, "extra"),
        ("not an object", "input"),
        ({"title": "T", "csv": "\n\n"}, "CSV is empty"),
        ({"title": "T", "csv": "a,b\n"}, "no data rows"),
        ({"title": "T", "csv": "a,b\n1,2\n3\n"}, "row 3 has 1 fields"),
        ({"title": "T", "csv": "a,b\n1,2,3\n"}, "row 2 has 3 fields"),
        ({"title": "T", "csv": "a,a\n1,2\n"}, "duplicate"),
        ({"title": "T", "csv": "a,\n1,2\n"}, "blank column name"),
        ({"title": "T", "csv": 'a\n"unterminated\n'}, "malformed CSV"),
    ],
)
def test_invalid_input_is_rejected_definitively(data: Any, fragment: str) -> None:
    with pytest.raises(ExecutorError) as caught:
        ReportExecutor().start(job(data))
    assert caught.value.reason_code == "invalid_report_input"
    assert caught.value.definitive is True
    assert fragment in str(caught.value)


def test_schema_is_valid_and_accepts_the_documented_shape() -> None:
    Draft202012Validator.check_schema(REPORT_INPUT_SCHEMA)
    validator = Draft202012Validator(REPORT_INPUT_SCHEMA)
    assert validator.is_valid({"title": "T", "csv": "a\n1\n", "format": "csv"})
    assert not validator.is_valid({"csv": "a\n1\n"})


def test_poll_and_fetch_of_a_synchronous_executor() -> None:
    executor = get_executor("report")
    assert isinstance(executor, ReportExecutor)
    started = executor.start(job({"title": "T", "csv": "n\n1\n"}))
    assert executor.poll(started.job_ref) == JobStatus.SUCCEEDED
    assert executor.poll("job_not_ours") == JobStatus.UNKNOWN
    with pytest.raises(ExecutorError) as caught:
        executor.fetch(started.job_ref)
    assert (caught.value.reason_code, caught.value.definitive) == ("not_fetchable", True)
