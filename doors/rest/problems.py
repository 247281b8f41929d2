"""RFC 9457 problem+json for every error the API can give."""

from __future__ import annotations

import logging
import math
import sys
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import Http404, HttpRequest, JsonResponse
from rest_framework import exceptions
from rest_framework.response import Response

from core.errors import DomainError, ErrorCode
from core.input_limits import JsonTooDeep, RefusedText
from core.outages import dependency_unreachable
from doors.rest.answers import DUPLICATE_HEADER, receipt_headers_of

logger = logging.getLogger(__name__)
PROBLEM_CONTENT_TYPE = "application/problem+json"

_DRF_CODES: list[tuple[type[Exception], ErrorCode]] = [
    (exceptions.NotAuthenticated, ErrorCode.NOT_AUTHENTICATED),
    (exceptions.AuthenticationFailed, ErrorCode.NOT_AUTHENTICATED),
    (exceptions.PermissionDenied, ErrorCode.PERMISSION_DENIED),
    (exceptions.NotFound, ErrorCode.NOT_FOUND),
    (Http404, ErrorCode.NOT_FOUND),
    (exceptions.MethodNotAllowed, ErrorCode.METHOD_NOT_ALLOWED),
    (exceptions.UnsupportedMediaType, ErrorCode.UNSUPPORTED_MEDIA_TYPE),
    (exceptions.Throttled, ErrorCode.THROTTLED),
    (exceptions.ParseError, ErrorCode.INVALID_REQUEST),
    (exceptions.NotAcceptable, ErrorCode.NOT_ACCEPTABLE),
    # Django's own upload cap (DATA_UPLOAD_MAX_MEMORY_SIZE), should anything read request.body.
    (RequestDataTooBig, ErrorCode.REQUEST_TOO_LARGE),
    (JsonTooDeep, ErrorCode.JSON_TOO_DEEP),
    (RefusedText, ErrorCode.INVALID_TEXT),
    (exceptions.ValidationError, ErrorCode.INVALID_REQUEST),
]


def problem_response(error: DomainError) -> Response:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else {}
    # A refusal about a purchase that can be polled points at it as a 202 does (Location), and
    # one that repeats an existing purchase says so as its answers do.
    if isinstance(error.extra.get("status_url"), str):
        headers["Location"] = error.extra["status_url"]
    if isinstance(error.extra.get("duplicate_of"), str):
        headers[DUPLICATE_HEADER] = error.extra["duplicate_of"]
    # A refusal that answers from the receipt (a payment id past retention, a result past
    # its retention) carries it signed, as a paid answer does.
    headers.update(receipt_headers_of(error.extra))
    return Response(
        error.as_problem(),
        status=error.spec.status,
        headers=headers,
        content_type=PROBLEM_CONTENT_TYPE,
    )


def _from_drf(exc: Exception) -> DomainError | None:
    for exc_type, code in _DRF_CODES:
        if isinstance(exc, exc_type):
            extra: dict[str, Any] = {}
            detail = str(getattr(exc, "detail", "")) or ""
            if isinstance(exc, exceptions.ValidationError):
                extra["errors"] = exc.detail
                detail = "The request body is invalid."
            error = DomainError(code, detail, extra=extra)
            wait = getattr(exc, "wait", None)
            if isinstance(exc, exceptions.Throttled) and wait is not None:
                # Never "Retry-After: 0": a client would retry at once and be refused again.
                error.retry_after = max(1, math.ceil(wait))
            return error
    return None


def problem_exception_handler(exc: Exception, context: dict[str, Any]) -> Response:
    """DRF's exception handler: anticipated errors as problems, anything else a logged 500."""
    error = exc if isinstance(exc, DomainError) else _from_drf(exc)
    if error is None and dependency_unreachable(exc):
        error = unavailable(exc, context.get("view").__class__.__name__)
    if error is None:
        logger.exception("unanticipated error in %s", context.get("view").__class__.__name__)
        error = DomainError(ErrorCode.INTERNAL_ERROR)
    response = problem_response(error)
    if isinstance(exc, exceptions.NotAuthenticated | exceptions.AuthenticationFailed):
        response["WWW-Authenticate"] = 'Bearer realm="tollbooth"'
    return response


def unavailable(exc: BaseException, where: str) -> DomainError:
    """A dependency is unreachable: 503 with Retry-After, logged in one line (an outage
    makes hundreds of these; the first one's traceback says nothing the line does not)."""
    logger.warning("dependency unreachable in %s: %r", where, exc)
    return DomainError(
        ErrorCode.SERVICE_UNAVAILABLE,
        retry_after=settings.TOLLBOOTH["UNAVAILABLE_RETRY_AFTER_SECONDS"],
    )


def _plain_problem(code: ErrorCode) -> JsonResponse:
    return _plain_error(DomainError(code))


def _plain_error(error: DomainError) -> JsonResponse:
    response = JsonResponse(
        error.as_problem(), status=error.spec.status, content_type=PROBLEM_CONTENT_TYPE
    )
    if error.retry_after is not None:
        response["Retry-After"] = str(error.retry_after)
    return response


def not_found_view(request: HttpRequest, exception: Exception) -> JsonResponse:
    """handler404: a path that matches no route is a problem too, never an HTML page."""
    return _plain_problem(ErrorCode.NOT_FOUND)


def bad_request_view(request: HttpRequest, exception: Exception) -> JsonResponse:
    """handler400: Django's own refusals (a bad Host header, say) as problem+json."""
    return _plain_problem(ErrorCode.INVALID_REQUEST)


def server_error_view(request: HttpRequest) -> JsonResponse:
    """handler500: anything that escaped a view; logged by Django, no trace leaked. An
    unreachable database or broker outside the API's views (a middleware, the admin) is a
    503 with Retry-After there too."""
    exc = sys.exc_info()[1]
    if exc is not None and dependency_unreachable(exc):
        return _plain_error(unavailable(exc, request.path))
    return _plain_problem(ErrorCode.INTERNAL_ERROR)
