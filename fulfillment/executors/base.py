"""The executor interface: start(job) -> job_ref, poll(job_ref), fetch(job_ref).

A synchronous executor may finish inside `start` and return the output with the ref.
Executors see a `JobSpec`, not the ORM: they stay independent of how purchases are stored.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol


@dataclass(frozen=True)
class JobSpec:
    purchase_ref: str
    operation: str
    input: dict[str, Any]
    # Derived from our own ids, so a second `start` for the same purchase finds the first job.
    idempotency_key: str


@dataclass(frozen=True)
class JobOutput:
    content: bytes
    content_type: str


@dataclass(frozen=True)
class Started:
    job_ref: str
    output: JobOutput | None = None  # set when the executor finished inside start


class JobStatus(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"  # the job service cannot say: never treat as failed


class ExecutorError(Exception):
    """The executor could not do what was asked.

    `definitive` is True only when the work provably did not and will not happen
    (e.g. the input was rejected). Anything else (timeouts, 5xx) leaves the effect unknown.
    """

    def __init__(self, reason_code: str, message: str = "", *, definitive: bool = False) -> None:
        super().__init__(message or reason_code)
        self.reason_code = reason_code
        self.definitive = definitive


class Executor(Protocol):
    name: str
    # True for pure, in-process work: resuming calls `start` again (same input, same bytes)
    # instead of poll/fetch, because nothing outside the process kept the output.
    finishes_in_start: bool

    def start(self, job: JobSpec) -> Started: ...

    def poll(self, job_ref: str) -> JobStatus: ...

    def fetch(self, job_ref: str) -> JobOutput: ...


_REGISTRY: dict[str, str] = {}


def register(name: str, dotted_path: str) -> None:
    _REGISTRY[name] = dotted_path


def registered_names() -> list[str]:
    return sorted(_REGISTRY)


def get_executor(name: str) -> Executor:
    try:
        dotted = _REGISTRY[name]
    except KeyError as exc:
        raise ExecutorError(
            "executor_not_registered", f"no executor named {name!r}", definitive=True
        ) from exc
    module_name, _, attr = dotted.rpartition(".")
    factory = getattr(importlib.import_module(module_name), attr)
    executor: Executor = factory()
    return executor


# The registry: one line per executor.
register("report", "fulfillment.executors.report.ReportExecutor")
register("http_job", "fulfillment.executors.http_job.HttpJobExecutor")
