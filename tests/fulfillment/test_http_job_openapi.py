"""Our job service (jobservice/) answers as the published http_job contract says
(docs/upstreams-http-job.openapi.yaml), so sellers can implement that document and trust it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import requests
import yaml
from jsonschema import Draft202012Validator

from tests.fixtures.jobservice import JobServiceProcess

DOC = Path(__file__).resolve().parents[2] / "docs" / "upstreams-http-job.openapi.yaml"


def check(spec: dict[str, Any], path: str, method: str, response: requests.Response) -> None:
    answers = spec["paths"][path][method]["responses"]
    assert str(response.status_code) in answers, (path, method, response.status_code)
    answer = answers[str(response.status_code)]
    if "$ref" in answer:
        answer = spec["components"]["responses"][answer["$ref"].rsplit("/", 1)[1]]
    schema = answer["content"].get("application/json", {}).get("schema")
    if schema is not None:
        # The schemas refer to #/components/...: resolve them inside the document itself.
        wrapped = {**schema, "components": spec["components"]}
        Draft202012Validator(wrapped).validate(response.json())


def test_the_job_service_matches_the_published_contract(job_service: JobServiceProcess) -> None:
    spec = yaml.safe_load(DOC.read_text())
    base = job_service.url
    body = {"operation": "word_stats", "input": {"text": "a b a", "duration_ms": 10}}
    headers = {"Idempotency-Key": "tollbooth-pur_openapi"}
    created = requests.post(f"{base}/jobs", json=body, headers=headers, timeout=5)
    check(spec, "/jobs", "post", created)
    assert created.status_code == 201
    again = requests.post(f"{base}/jobs", json=body, headers=headers, timeout=5)
    check(spec, "/jobs", "post", again)
    assert (again.status_code, again.json()["id"]) == (200, created.json()["id"])
    job_id = created.json()["id"]
    found = requests.get(
        f"{base}/jobs", params={"idempotency_key": headers["Idempotency-Key"]}, timeout=5
    )
    check(spec, "/jobs", "get", found)
    check(spec, "/jobs/{id}", "get", requests.get(f"{base}/jobs/{job_id}", timeout=5))
    missing = requests.get(f"{base}/jobs", params={"idempotency_key": "nope"}, timeout=5)
    check(spec, "/jobs", "get", missing)
    refused = requests.post(f"{base}/jobs", json={"operation": 1}, headers=headers, timeout=5)
    check(spec, "/jobs", "post", refused)
