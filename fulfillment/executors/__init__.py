"""Executors run the paid work. One module per executor, one line of registration."""

from fulfillment.executors.base import (
    Executor,
    ExecutorError,
    JobOutput,
    JobSpec,
    JobStatus,
    Started,
    UpstreamSpec,
    get_executor,
    register,
    registered_names,
)

__all__ = [
    "Executor",
    "ExecutorError",
    "JobOutput",
    "JobSpec",
    "JobStatus",
    "Started",
    "UpstreamSpec",
    "get_executor",
    "register",
    "registered_names",
]
