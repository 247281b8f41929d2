"""Every error code has a status, an owner and a documented line, and they agree."""

import re
from pathlib import Path

import pytest

from core.errors import CODE_SPECS, DomainError, ErrorCode

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
ROW = re.compile(
    r"^\| `(?P<code>[a-z0-9_]+)` \| (?P<status>\d{3}) \| (?P<owner>\w+) \| (?P<action>\w+) \| "
    r"(?P<retryable>yes|no) \| .+ \|$"
)


def documented() -> dict[str, dict[str, str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            rows[match["code"]] = match.groupdict()
    return rows


def test_every_code_has_a_spec():
    assert set(CODE_SPECS) == set(ErrorCode)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_code_is_documented_with_its_status(code):
    row = documented().get(code.value)
    assert row is not None, f"{code.value} missing from docs/errors.md"
    spec = CODE_SPECS[code]
    assert int(row["status"]) == spec.status
    assert row["owner"] == spec.owner.value
    assert row["action"] == spec.next_action
    assert (row["retryable"] == "yes") == spec.retryable


def test_docs_list_no_code_that_does_not_exist():
    assert set(documented()) == {code.value for code in ErrorCode}


def test_problem_body_carries_the_contract_fields():
    body = DomainError(ErrorCode.PAYMENT_IN_FLIGHT, purchase="pur_x", retry_after=2).as_problem()
    assert body["code"] == "payment_in_flight"
    assert body["status"] == 409
    assert {"type", "title", "detail", "purchase", "next_action", "owner", "retryable"} <= set(body)
