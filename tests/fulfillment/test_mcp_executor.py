"""The `mcp` executor against a real MCP server (devtools.sample_mcp_upstream, its own
process, Streamable HTTP): the purchase key travels in `_meta`, the tool's answer is the
result, and an unknown outcome escalates at once unless the tool is declared idempotent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from fulfillment.executors import ExecutorError, JobSpec, UpstreamSpec, get_executor

REPO_ROOT = Path(__file__).resolve().parents[2]
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class McpUpstream:
    def __init__(self, process: subprocess.Popen[bytes], port: int) -> None:
        self.process, self.base = process, f"http://127.0.0.1:{port}"

    def spec(self, **overrides: object) -> UpstreamSpec:
        fields: dict[str, object] = {
            "kind": "mcp",
            "url": self.base + "/mcp",
            "tool": "count",
            "timeout": 5.0,
            "max_result_bytes": 4096,
            **overrides,
        }
        return UpstreamSpec(**fields)  # type: ignore[arg-type]

    def stats(self) -> dict[str, int]:
        with _OPENER.open(self.base + "/stats", timeout=5) as response:
            stats: dict[str, int] = json.loads(response.read())
            return stats


@pytest.fixture
def mcp_upstream(tmp_path: Path) -> Iterator[McpUpstream]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "devtools.sample_mcp_upstream"]
    process = subprocess.Popen(
        [*command, "--db", str(tmp_path / "mcp.sqlite3")], stdout=subprocess.PIPE, env=env
    )
    assert process.stdout is not None
    line = process.stdout.readline().decode()
    assert line.startswith("sample mcp upstream listening on "), line
    yield McpUpstream(process, int(line.rsplit(" ", 1)[1]))
    process.kill()
    process.wait(5)


def job(key: str = "tollbooth-pur_m1", **input_: object) -> JobSpec:
    return JobSpec(
        purchase_ref="pur_m1",
        operation="count",
        input={"text": "hi", **input_},
        idempotency_key=key,
    )


def test_a_tool_call_is_the_result_and_carries_the_key(mcp_upstream: McpUpstream) -> None:
    executor = get_executor("mcp", mcp_upstream.spec())
    started = executor.start(job())
    assert started.output is not None
    assert started.output.content_type == "application/json"
    assert json.loads(started.output.content) == {
        "key": "tollbooth-pur_m1",
        "effect": 1,
        "text": "HI",
    }
    assert mcp_upstream.stats()["effects"] == 1


def test_an_unknown_outcome_escalates_unless_the_tool_is_idempotent(
    mcp_upstream: McpUpstream,
) -> None:
    with pytest.raises(ExecutorError) as plain:
        get_executor("mcp", mcp_upstream.spec(timeout=0.5)).start(job(sleep=3))
    assert (plain.value.definitive, plain.value.retryable) == (False, False)
    with pytest.raises(ExecutorError) as declared:
        get_executor("mcp", mcp_upstream.spec(timeout=0.5, idempotent=True)).start(job(sleep=3))
    assert (declared.value.definitive, declared.value.retryable) == (False, True)
    assert mcp_upstream.stats()["effects"] == 1  # the server deduped by the key in _meta


def test_an_answer_over_the_cap_escalates(mcp_upstream: McpUpstream) -> None:
    with pytest.raises(ExecutorError) as caught:
        get_executor("mcp", mcp_upstream.spec(max_result_bytes=10)).start(job())
    error = caught.value
    assert (error.reason_code, error.retryable) == ("upstream_result_too_large", False), error


def test_an_unreachable_server_is_unknown_never_failed(mcp_upstream: McpUpstream) -> None:
    mcp_upstream.process.kill()
    mcp_upstream.process.wait(5)
    with pytest.raises(ExecutorError) as caught:
        get_executor("mcp", mcp_upstream.spec(timeout=1.0)).start(job())
    assert caught.value.definitive is False


def _mcp_purchase(buyer, mcp_upstream: McpUpstream, data: dict, **config: object):  # type: ignore[no-untyped-def]
    from doors.rest.prepaid_answers import PrepaidAnswers
    from fulfillment.models import Upstream
    from purchases.models import Purchase
    from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
    from purchases.services.quote.quotes import quote_create
    from tests.factories import OfferingFactory

    offering = OfferingFactory.create(executor="mcp", input_schema={"type": "object"})
    Upstream.objects.create(
        offering=offering, kind="mcp", url=mcp_upstream.base + "/mcp", tool="count", **config
    )
    quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=data).quote
    answer, _ = purchase_pay_prepaid(
        answers=PrepaidAnswers(),
        buyer=buyer,
        quote_id=quote.public_id,
        payment_id=f"mcp-upstream-{data['request_id']}-0001",
    )
    return Purchase.objects.get(ref=answer.purchase_ref)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_purchase_runs_once_and_an_unknown_call_escalates_at_once(
    buyer, mcp_upstream: McpUpstream
) -> None:
    from fulfillment.models import Result
    from payments.models import Refund
    from purchases.services.fulfil.execution import ExecutionOutcome, purchase_execute

    done = _mcp_purchase(buyer, mcp_upstream, {"text": "hi", "request_id": "a"})
    assert purchase_execute(purchase_id=done.pk, worker="w1") == ExecutionOutcome.SUCCEEDED
    assert json.loads(bytes(Result.objects.get(purchase=done).body))["key"] == (
        f"tollbooth-{done.ref}"
    )
    slow = _mcp_purchase(
        buyer, mcp_upstream, {"text": "hi", "sleep": 3, "request_id": "b"}, timeout_seconds=1
    )
    # Not idempotent: no second call, the outcome goes to support at the first unknown.
    assert purchase_execute(purchase_id=slow.pk, worker="w1") == ExecutionOutcome.ESCALATED
    slow.refresh_from_db()
    assert slow.fulfillment_state == "unknown"
    assert not Refund.objects.filter(purchase=slow).exists()
    assert mcp_upstream.stats() == {"effects": 2, "calls": 2}


@pytest.mark.django_db
def test_the_check_lists_tools_and_calls_none(mcp_upstream: McpUpstream) -> None:
    from fulfillment.upstream_check import upstream_check

    check = upstream_check(mcp_upstream.spec())
    assert check.ok, check.lines
    assert any("tool 'count' is listed" in finding for _, finding in check.lines)
    assert not upstream_check(mcp_upstream.spec(tool="nope")).ok
    assert mcp_upstream.stats() == {"effects": 0, "calls": 0}
