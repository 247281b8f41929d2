"""The `top_up` executor: the built-in offering kind that credits a prepaid balance.

The credit itself is not made here. The ledger lives in `payments`, which `fulfillment` may
not import, and the credit must commit in the same transaction as the stored result (no
credit without a result, no result without a credit, never two): the orchestration posts it
when it records this execution's success (purchases.services.fulfil.top_ups) and stores the
credit's document in place of this output. Here the work is only what a run leaves behind
to be recorded: pure, in-process, the same bytes on every start.
"""

from __future__ import annotations

from core.canonical import canonical_json
from fulfillment.executors.base import ExecutorError, JobOutput, JobSpec, JobStatus, Started

TOP_UP_EXECUTOR = "top_up"


class TopUpExecutor:
    name = TOP_UP_EXECUTOR
    finishes_in_start = True

    def start(self, job: JobSpec) -> Started:
        output = JobOutput(canonical_json({"top_up": job.input}).encode(), "application/json")
        return Started(job_ref=f"top_up_{job.purchase_ref}", output=output)

    def poll(self, job_ref: str) -> JobStatus:
        return JobStatus.SUCCEEDED

    def fetch(self, job_ref: str) -> JobOutput:
        # Nothing is kept: a resumed run calls start again (finishes_in_start).
        raise ExecutorError("not_fetchable", definitive=True)
