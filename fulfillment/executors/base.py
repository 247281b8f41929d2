"""The executor interface: start(job) -> job_ref, poll(job_ref), fetch(job_ref).

A synchronous executor may finish inside `start` and return the output with the ref.
Executors see a `JobSpec`, not the ORM: they stay independent of how purchases are stored.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from enum import StrEnum
from importlib.metadata import entry_points
from typing import Any, NamedTuple, Protocol

# A seller's own package adds an executor by declaring an entry point in this group:
#   [project.entry-points."tollbooth.executors"]
#   my_work = "my_package.module:MyExecutor"
ENTRY_POINT_GROUP = "tollbooth.executors"


class SigningKey(NamedTuple):
    key_id: str  # "" for a secret configured without one (the header of before)
    env: str  # the variable's name, for messages
    secret: bytes


@dataclass(frozen=True)
class UpstreamSpec:
    """What an executor needs to know about the offering's upstream (fulfillment.Upstream),
    frozen at claim time. The signing secret is named, never carried: `secret()` reads it."""

    kind: str
    url: str = ""
    method: str = "POST"
    timeout: float = 10.0
    input_mode: str = "json"  # "json": canonical JSON body; "query": input as query parameters
    secret_env: str = ""
    # A rotation (docs/upstreams.md): the current secret's key id, and the secret being
    # replaced, still signed with until it is retired.
    key_id: str = ""
    previous_secret_env: str = ""
    previous_key_id: str = ""
    definitive_statuses: frozenset[int] = frozenset()
    max_result_bytes: int = 1024 * 1024
    idempotent: bool = False
    entry_point: str = ""
    tool: str = ""
    dry_run: dict[str, Any] = field(default_factory=dict)
    # The offering's own retry budget; None: the deployment's settings.
    max_tries: int | None = None
    deadline_seconds: int | None = None

    def secret(self) -> bytes:
        """The signing secret from the environment, or b"" when unset (the executor refuses
        to call then: an unsigned call would be refused or, worse, accepted)."""
        return _env_secret(self.secret_env)

    def signing_keys(self) -> list[SigningKey]:
        """Every key a call is signed with: the current secret first, then the previous one
        during a rotation. A named but unset variable gives secret b"" (no call is made)."""
        keys = [SigningKey(self.key_id, self.secret_env, self.secret())]
        if self.previous_secret_env:
            previous = self.previous_secret_env
            keys.append(SigningKey(self.previous_key_id, previous, _env_secret(previous)))
        return keys

    @property
    def executor_name(self) -> str:
        return self.entry_point if self.kind == "python" else self.kind


def _env_secret(name: str) -> bytes:
    return os.environ.get(name, "").encode() if name else b""


@dataclass(frozen=True)
class JobSpec:
    purchase_ref: str
    operation: str
    input: dict[str, Any]
    # Derived from our own ids, so a second `start` for the same purchase finds the first job.
    idempotency_key: str
    upstream: UpstreamSpec | None = None


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

    def __init__(
        self,
        reason_code: str,
        message: str = "",
        *,
        definitive: bool = False,
        retryable: bool = True,
    ) -> None:
        super().__init__(message or reason_code)
        self.reason_code = reason_code
        self.definitive = definitive
        # False for an unknown outcome that another try cannot settle (an answer over the
        # size cap, a call that is not idempotent): escalate now instead of retrying.
        self.retryable = retryable


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
    return sorted({*_REGISTRY, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})


def _factory(name: str) -> Any:
    dotted = _REGISTRY.get(name)
    if dotted is not None:
        module_name, _, attr = dotted.rpartition(".")
        return getattr(importlib.import_module(module_name), attr)
    # Read on each call, not cached: a package installed after start-up is found too.
    for point in entry_points(group=ENTRY_POINT_GROUP, name=name):
        return point.load()
    raise ExecutorError("executor_not_registered", f"no executor named {name!r}", definitive=True)


def get_executor(name: str, upstream: UpstreamSpec | None = None) -> Executor:
    """The executor registered as `name` (here, or by an installed package's entry point),
    built for the offering's upstream when it has one."""
    factory = _factory(name)
    executor: Executor = factory(upstream=upstream) if upstream is not None else factory()
    return executor


# The registry: one line per executor.
register("report", "fulfillment.executors.report.ReportExecutor")
register("http_job", "fulfillment.executors.http_job.HttpJobExecutor")
register("http", "fulfillment.executors.http.HttpExecutor")
register("mcp", "fulfillment.executors.mcp.McpExecutor")
register("top_up", "fulfillment.executors.top_up.TopUpExecutor")
