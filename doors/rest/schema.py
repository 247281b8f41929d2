"""What the OpenAPI schema says beyond the views: the API-key auth and problem+json errors.

Every error is RFC 9457 `application/problem+json` (doors/rest/problems.py). Rather
than repeat the refusals every operation can give on each view, one post-processing hook
declares them: 400 (malformed, too deep, NUL), 406, 413 and 415 (operations with a body),
401 (keyed operations), 404 (operations with path parameters), 429 (throttled operations),
500 and 503 (operations that read the database); 429 and 503 with their Retry-After; and
every 4xx/5xx body is described as problem+json.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension

PROBLEM_MEDIA_TYPE = "application/problem+json"
PROBLEM_REF = {"$ref": "#/components/schemas/Problem"}
THROTTLED_PATHS = ("/api/v1/quotes", "/x402/")
# Paths whose answers come from the database (or the broker): 503 while one is down.
DEPENDENT_PATHS = ("/api/v1/", "/x402/")
_DESCRIPTIONS = {
    "400": "Malformed request (invalid_request, json_too_deep, invalid_text, ...).",
    "401": "No or unknown API key (not_authenticated).",
    "404": "No such resource for this buyer.",
    "406": "Accept excludes JSON (not_acceptable).",
    "413": "Body over the size limit (request_too_large).",
    "415": "Send application/json (unsupported_media_type).",
    "429": "Too many requests (throttled); see Retry-After.",
    "500": "Unexpected (internal_error).",
    "503": "A dependency is down (service_unavailable, verification_unavailable, "
    "settlement_unavailable); nothing "
    "is lost: retry the same request, with the same key, after Retry-After.",
}
# Every 429 and 503 says when to come back.
_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before the same request again.",
        "schema": {"type": "integer", "minimum": 1},
    }
}


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "doors.rest.auth.ApiKeyAuthentication"
    name = "ApiKey"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "`Authorization: Bearer <api key>`; the key names the buyer.",
        }


def _problem_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {PROBLEM_MEDIA_TYPE: {"schema": PROBLEM_REF}}}


def _statuses_for(path: str, operation: dict[str, Any]) -> list[str]:
    statuses = ["400", "406", "500"]
    if "requestBody" in operation:
        statuses += ["413", "415"]
    security = operation.get("security") or []
    if security and {} not in security:
        statuses.append("401")
    if any(p.get("in") == "path" for p in operation.get("parameters", [])):
        statuses.append("404")
    if path.startswith(THROTTLED_PATHS) and operation.get("requestBody"):
        statuses.append("429")
    if path.startswith(DEPENDENT_PATHS):
        statuses.append("503")
    return statuses


def problem_responses_hook(
    result: dict[str, Any], generator: Any, request: Any, public: bool
) -> dict[str, Any]:
    """drf-spectacular POSTPROCESSING_HOOK: declare the problem+json answers."""
    for path, methods in result.get("paths", {}).items():
        for operation in methods.values():
            responses = operation.setdefault("responses", {})
            for status, response in responses.items():
                if status[0] in "45" and "content" in response:
                    response["content"] = {PROBLEM_MEDIA_TYPE: {"schema": PROBLEM_REF}}
            for status in _statuses_for(path, operation):
                responses.setdefault(status, _problem_response(_DESCRIPTIONS[status]))
            for status in ("429", "503"):
                if status in responses:
                    responses[status].setdefault("headers", {}).update(_RETRY_AFTER)
    return result
