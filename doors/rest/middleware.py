"""Hardening that applies to every request and answer, before and after any view runs."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.http.response import HttpResponseBase

from core.errors import DomainError, ErrorCode
from core.input_limits import RefusedText, text_check
from core.middleware import BothModesMiddleware
from doors.rest.problems import PROBLEM_CONTENT_TYPE

# Answers under these prefixes are about money or one buyer's purchase: no shared or
# private cache may keep them (a cached 402, status or result is wrong or leaks).
NO_STORE_PREFIXES = ("/api/v1/", "/x402/")


def _request_text(request: HttpRequest) -> list[str]:
    texts = [request.path_info]
    for key, values in request.GET.lists():
        texts.append(key)
        texts.extend(values)
    texts.extend(v for k, v in request.META.items() if k.startswith("HTTP_") and isinstance(v, str))
    return texts


class HostileInputMiddleware(BothModesMiddleware):
    """Refuse NUL or unpaired surrogates in the path, query or headers with a 400.

    The database refuses such text; without this a lookup by path or header is a 500.
    Bodies are checked by the JSON parser (doors.rest.parsers).
    """

    def answer(self, request: HttpRequest) -> HttpResponseBase | None:
        try:
            for text in _request_text(request):
                text_check(text)
        except RefusedText as exc:
            error = DomainError(ErrorCode.INVALID_TEXT, str(exc))
            return JsonResponse(
                error.as_problem(), status=error.spec.status, content_type=PROBLEM_CONTENT_TYPE
            )
        return None


class NoStoreMiddleware(BothModesMiddleware):
    """`Cache-Control: no-store` on paid answers, purchase state, results, receipts, problems."""

    def finish(self, request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
        is_problem = response.get("Content-Type", "").startswith(PROBLEM_CONTENT_TYPE)
        if is_problem or request.path_info.startswith(NO_STORE_PREFIXES):
            response["Cache-Control"] = "no-store"
        return response
