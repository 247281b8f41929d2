"""The http_job executor against the real job service, run as a separate process.

Every ambiguous failure (timeout, 5xx, unreachable) must leave the effect unknown, and no
retry may ever create a second job: /stats counts what the service really did.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import requests

from fulfillment.executors import ExecutorError, JobSpec, JobStatus, get_executor
from fulfillment.executors.http_job import HttpJobExecutor
from tests.fixtures.jobservice import JobServiceProcess

TEXT = "the cat and the hat and the bat"


def job(key: str = "exec-pur_1", **input_: Any) -> JobSpec:
    data = {"text": TEXT, "duration_ms": 50, **input_}
    return JobSpec(purchase_ref="pur_1", operation="word_stats", input=data, idempotency_key=key)


def executor(service: JobServiceProcess, timeout: float = 2.0) -> HttpJobExecutor:
    return HttpJobExecutor(base_url=service.url, timeout=timeout)


def wait_until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def finished_status(ex: HttpJobExecutor, job_ref: str, timeout: float = 5.0) -> JobStatus:
    deadline = time.monotonic() + timeout
    while (status := ex.poll(job_ref)) == JobStatus.RUNNING:
        assert time.monotonic() < deadline, "the job did not finish in time"
        time.sleep(0.02)
    return status


def test_start_poll_fetch(job_service: JobServiceProcess) -> None:
    ex = executor(job_service)
    started = ex.start(job())
    assert started.job_ref.startswith("job_")
    assert started.output is None
    assert finished_status(ex, started.job_ref) == JobStatus.SUCCEEDED
    output = ex.fetch(started.job_ref)
    assert output.content_type == "application/json"
    result = json.loads(output.content)
    assert (result["word_count"], result["unique_words"]) == (8, 5)
    assert result["top_words"][:2] == [{"word": "the", "count": 3}, {"word": "and", "count": 2}]
    assert ex.fetch(started.job_ref).content == output.content


def test_start_twice_with_one_key_makes_one_job(job_service: JobServiceProcess) -> None:
    ex = executor(job_service)
    assert ex.start(job()).job_ref == ex.start(job()).job_ref
    assert job_service.stats() == {"jobs_created": 1, "create_requests": 2, "replayed": 1}


def test_crash_before_recording_the_ref_finds_the_same_job(job_service: JobServiceProcess) -> None:
    first = executor(job_service).start(job())  # ...and the worker dies before saving the ref
    again = executor(job_service).start(job())  # a new worker, a new process, the same key
    assert again.job_ref == first.job_ref
    assert job_service.stats()["jobs_created"] == 1


@pytest.mark.parametrize(
    "faults",
    [
        {"fail_next": 1, "after_processing": True},  # created, but the answer is a 503
        {"hang_next": 1, "hang_seconds": 2.0, "after_processing": True},  # created, answer late
    ],
)
def test_job_created_behind_an_error_is_found_by_key(
    job_service: JobServiceProcess, faults: dict[str, Any]
) -> None:
    job_service.set_faults(**faults)
    started = executor(job_service, timeout=0.5).start(job())
    assert job_service.stats()["jobs_created"] == 1
    assert executor(job_service).start(job()).job_ref == started.job_ref
    assert job_service.stats()["jobs_created"] == 1


def test_service_answering_503(job_service: JobServiceProcess) -> None:
    ex = executor(job_service)
    job_service.set_faults(fail_next=2)  # the create and the lookup both fail
    with pytest.raises(ExecutorError) as caught:
        ex.start(job())
    assert (caught.value.reason_code, caught.value.definitive) == ("job_service_unavailable", False)
    assert job_service.stats()["jobs_created"] == 0

    started = ex.start(job())
    job_service.set_faults(fail_next=2)
    assert ex.poll(started.job_ref) == JobStatus.UNKNOWN
    with pytest.raises(ExecutorError) as fetch_error:
        ex.fetch(started.job_ref)
    assert fetch_error.value.definitive is False
    assert finished_status(ex, started.job_ref) == JobStatus.SUCCEEDED
    assert job_service.stats()["jobs_created"] == 1


def test_lookup_miss_after_timeout_is_not_proof(job_service: JobServiceProcess) -> None:
    # The create hangs before taking effect; the lookup answers 404 meanwhile; then the
    # abandoned create completes. Had we called the 404 definitive, the work would be lost.
    job_service.set_faults(hang_next=1, hang_seconds=1.0)
    with pytest.raises(ExecutorError) as caught:
        executor(job_service, timeout=0.3).start(job())
    assert caught.value.definitive is False
    wait_until(lambda: job_service.stats()["jobs_created"] == 1)
    executor(job_service).start(job())
    assert job_service.stats() == {"jobs_created": 1, "create_requests": 2, "replayed": 1}


def test_hanging_service_times_out_non_definitively(job_service: JobServiceProcess) -> None:
    ex = executor(job_service, timeout=0.2)
    started = ex.start(job())
    job_service.set_faults(hang_next=10, hang_seconds=1.0)
    with pytest.raises(ExecutorError) as caught:
        ex.start(job(key="exec-pur_2"))
    assert (caught.value.reason_code, caught.value.definitive) == ("job_service_unavailable", False)
    assert ex.poll(started.job_ref) == JobStatus.UNKNOWN
    with pytest.raises(ExecutorError) as fetch_error:
        ex.fetch(started.job_ref)
    assert fetch_error.value.definitive is False


def test_unreachable_service(job_service: JobServiceProcess) -> None:
    ex = executor(job_service, timeout=0.5)
    started = ex.start(job())
    job_service.stop()
    assert ex.poll(started.job_ref) == JobStatus.UNKNOWN
    with pytest.raises(ExecutorError) as caught:
        ex.start(job())
    assert caught.value.definitive is False


def test_failing_job_polls_failed(job_service: JobServiceProcess) -> None:
    ex = executor(job_service)
    started = ex.start(job(fail=True, duration_ms=0))
    assert ex.poll(started.job_ref) == JobStatus.FAILED
    with pytest.raises(ExecutorError) as caught:
        ex.fetch(started.job_ref)
    assert caught.value.definitive is False


@pytest.mark.parametrize(
    "bad_job",
    [
        JobSpec(purchase_ref="p", operation="nope", input={}, idempotency_key="k1"),
        JobSpec(purchase_ref="p", operation="word_stats", input={"text": 3}, idempotency_key="k2"),
    ],
)
def test_rejected_input_is_definitive(job_service: JobServiceProcess, bad_job: JobSpec) -> None:
    with pytest.raises(ExecutorError) as caught:
        executor(job_service).start(bad_job)
    assert (caught.value.reason_code, caught.value.definitive) == ("job_rejected", True)
    assert job_service.stats()["jobs_created"] == 0


def test_key_reused_with_another_input_is_rejected(job_service: JobServiceProcess) -> None:
    ex = executor(job_service)
    ex.start(job())
    with pytest.raises(ExecutorError) as caught:
        ex.start(job(text="something else"))
    assert (caught.value.reason_code, caught.value.definitive) == ("job_rejected", True)
    assert job_service.stats()["jobs_created"] == 1


def test_registry_builds_the_executor_from_settings(
    job_service: JobServiceProcess, settings: Any
) -> None:
    settings.TOLLBOOTH = {
        **settings.TOLLBOOTH,
        "JOB_SERVICE_URL": job_service.url + "/",
        "JOB_SERVICE_TIMEOUT": 1.5,
    }
    ex = get_executor("http_job")
    assert isinstance(ex, HttpJobExecutor)
    assert (ex.base_url, ex.timeout) == (job_service.url, 1.5)
    assert ex.start(job()).job_ref.startswith("job_")


def test_service_api_edges(job_service: JobServiceProcess) -> None:
    url = job_service.url
    body = {"operation": "word_stats", "input": {"text": "a", "duration_ms": 60_000}}
    assert requests.post(f"{url}/jobs", json=body, timeout=2).status_code == 400  # no key
    created = requests.post(f"{url}/jobs", json=body, headers={"Idempotency-Key": "k"}, timeout=2)
    assert (created.status_code, created.json()["created"]) == (201, True)
    job_id = created.json()["id"]
    assert requests.get(f"{url}/jobs/{job_id}/result", timeout=2).status_code == 409
    assert requests.get(f"{url}/jobs/job_missing", timeout=2).status_code == 404
    assert requests.get(f"{url}/jobs/job_missing/result", timeout=2).status_code == 404
    assert (
        requests.get(f"{url}/jobs", params={"idempotency_key": "x"}, timeout=2).status_code == 404
    )
    found = requests.get(f"{url}/jobs", params={"idempotency_key": "k"}, timeout=2).json()
    assert found == {"id": job_id, "status": "running", "operation": "word_stats"}
