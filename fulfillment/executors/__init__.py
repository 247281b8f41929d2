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
from fulfillment.executors.top_up import TOP_UP_EXECUTOR

__all__ = [
    "TOP_UP_EXECUTOR",
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
