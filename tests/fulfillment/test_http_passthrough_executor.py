"""The `http` executor in `request` mode against the sample upstream (its own process): the
passed request arrives as it was sent, signed (query and body included), once per key; a
stored input that is not a passed request, or whose path escapes, is never sent."""

from __future__ import annotations

import json

import pytest

from fulfillment.executors import ExecutorError, JobSpec
from fulfillment.executors.http import HttpExecutor
from fulfillment.executors.passthrough import PassedRequest, request_input
from tests.fixtures.sample_upstream import SampleUpstream


def job(data: dict[str, object]) -> JobSpec:
    return JobSpec(
        purchase_ref="pur_1", operation="api", input=data, idempotency_key="tollbooth-pur_1"
    )


def test_the_request_arrives_unchanged_and_a_repeat_has_no_second_effect(
    sample_upstream: SampleUpstream,
) -> None:
    executor = HttpExecutor(
        sample_upstream.spec(url=sample_upstream.url + "/api/", input_mode="request")
    )
    passed = PassedRequest("PATCH", "/things/1;v=2", "x=1&x=2&y=%C3%A9", "text/plain", b"hi \xff")
    first = executor.start(job(request_input(passed)))
    again = executor.start(job(request_input(passed)))
    assert first.output is not None and again.output is not None
    assert json.loads(first.output.content)["input"] == {
        "method": "PATCH",
        "target": "/api/things/1;v=2?x=1&x=2&y=%C3%A9",
        "content_type": "text/plain",
        "body": "hi \ufffd",  # the sample upstream decodes for its echo; the bytes were signed
    }
    assert again.output.content == first.output.content
    assert sample_upstream.stats() == {"effects": 1, "calls": 2, "replayed": 1, "refused": 0}


@pytest.mark.parametrize(
    "data",
    [
        {"q": "an input for the offering's own URL"},
        {"method": "GET", "path": "/a/../../admin", "query": "", "body": ""},
        {"method": "TRACE", "path": "/a", "query": "", "body": ""},
    ],
)
def test_an_input_that_is_not_a_passed_request_is_never_sent(
    sample_upstream: SampleUpstream, data: dict[str, object]
) -> None:
    executor = HttpExecutor(
        sample_upstream.spec(url=sample_upstream.url + "/api", input_mode="request")
    )
    with pytest.raises(ExecutorError) as refused:
        executor.start(job(data))
    assert (refused.value.reason_code, refused.value.definitive) == ("upstream_rejected", True)
    assert sample_upstream.stats()["calls"] == 0
