"""The `http_job` executor: runs work on an external job service over HTTP (see jobservice/).

The rule throughout: only a clear refusal by the service is definitive. A timeout, a dropped
connection or a 5xx may hide a job that was created, so `start` looks the job up by its
idempotency key before giving up, and gives up only with a non-definitive error (a later
`start` with the same key is safe: the service replays the first job). `poll` answers
UNKNOWN, never FAILED, when it cannot reach the service; `fetch` never fails definitively.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote

import requests
from django.conf import settings

from fulfillment.executors.base import (
    ExecutorError,
    JobOutput,
    JobSpec,
    JobStatus,
    Started,
    UpstreamSpec,
)

logger = logging.getLogger(__name__)

# 4xx answers that mean "not now", not "never": the job may exist or may still be created.
_TRANSIENT_4XX = frozenset({408, 409, 425, 429})
_STATUSES = {
    "running": JobStatus.RUNNING,
    "succeeded": JobStatus.SUCCEEDED,
    "failed": JobStatus.FAILED,
}


class HttpJobExecutor:
    name = "http_job"
    finishes_in_start = False

    def __init__(
        self,
        base_url: str | None = None,
        timeout: float | None = None,
        session: requests.Session | None = None,
        upstream: UpstreamSpec | None = None,
    ) -> None:
        if upstream is not None and upstream.url:
            # The offering's own job service; JOB_SERVICE_URL stays the default.
            base_url, timeout = upstream.url, upstream.timeout
        if base_url is None or timeout is None:
            config = settings.TOLLBOOTH
            base_url = base_url if base_url is not None else config["JOB_SERVICE_URL"]
            timeout = timeout if timeout is not None else config["JOB_SERVICE_TIMEOUT"]
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.session = session or requests.Session()

    def start(self, job: JobSpec) -> Started:
        try:
            response = self._request(
                "POST",
                "/jobs",
                json={"operation": job.operation, "input": job.input},
                headers={"Idempotency-Key": job.idempotency_key},
            )
        except requests.RequestException as exc:
            return self._find_started(job, cause=f"create request failed: {exc}")
        status = response.status_code
        if status in (200, 201):
            job_id = _job_id(response)
            if job_id is not None:
                return Started(job_ref=job_id)
            return self._find_started(job, cause=f"unreadable {status} answer to create")
        if 400 <= status < 500 and status not in _TRANSIENT_4XX:
            # The service refused this request: no job exists for it and none will.
            raise ExecutorError("job_rejected", _describe(response), definitive=True)
        return self._find_started(job, cause=f"create answered {_describe(response)}")

    def poll(self, job_ref: str) -> JobStatus:
        try:
            response = self._request("GET", f"/jobs/{quote(job_ref, safe='')}")
        except requests.RequestException as exc:
            logger.warning("poll of %s failed: %s", job_ref, exc)
            return JobStatus.UNKNOWN
        if response.status_code != 200:
            logger.warning("poll of %s answered %s", job_ref, _describe(response))
            return JobStatus.UNKNOWN
        return _STATUSES.get(str(_json(response).get("status")), JobStatus.UNKNOWN)

    def fetch(self, job_ref: str) -> JobOutput:
        try:
            response = self._request("GET", f"/jobs/{quote(job_ref, safe='')}/result")
        except requests.RequestException as exc:
            raise ExecutorError("result_unavailable", f"fetch failed: {exc}") from exc
        if response.status_code != 200:
            # Even a 404 is not proof the work did not happen: escalate, never fail it.
            raise ExecutorError("result_unavailable", f"fetch answered {_describe(response)}")
        content_type = response.headers.get("Content-Type") or "application/octet-stream"
        return JobOutput(content=response.content, content_type=content_type)

    def _find_started(self, job: JobSpec, *, cause: str) -> Started:
        """The create may or may not have happened: ask the service by idempotency key."""
        logger.warning("job %s: %s; looking it up by key", job.purchase_ref, cause)
        try:
            response = self._request(
                "GET", "/jobs", params={"idempotency_key": job.idempotency_key}
            )
        except requests.RequestException as exc:
            raise _unavailable(f"{cause}; lookup failed: {exc}") from exc
        job_id = _job_id(response) if response.status_code == 200 else None
        if job_id is None:
            # A 404 is no proof either: the create may still be in flight on the service.
            raise _unavailable(f"{cause}; lookup answered {_describe(response)}")
        return Started(job_ref=job_id)

    def _request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        return self.session.request(method, self.base_url + path, timeout=self.timeout, **kwargs)


def _unavailable(message: str) -> ExecutorError:
    return ExecutorError("job_service_unavailable", message, definitive=False)


def _json(response: requests.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _job_id(response: requests.Response) -> str | None:
    job_id = _json(response).get("id")
    return job_id if isinstance(job_id, str) and job_id else None


def _describe(response: requests.Response) -> str:
    error = _json(response).get("error")
    return f"HTTP {response.status_code}" + (f": {error}" if error else "")
