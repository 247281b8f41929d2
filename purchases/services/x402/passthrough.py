"""An existing API sold as it is: a paid `/x402/<offering>/<rest>` whose offering's http
upstream passes the request through (input mode `request`, docs/upstreams.md). The request
itself is the input, so the quote, the duplicate window and the timeline see its method,
path, query and body hash; everything after this is the paid URL's flow, unchanged."""

from __future__ import annotations

from typing import Any

from core.errors import DomainError, ErrorCode
from fulfillment.executors.passthrough import PassedRequest, passed_path_error, request_input
from fulfillment.models import Upstream

_NOT_PASSED = "This offering is sold at its own URL only: it passes no path through."


def x402_passed_input(
    *, offering_slug: str, request: PassedRequest, raw_path: str | None
) -> dict[str, Any]:
    """The purchase input for a request below an offering's paid URL. `raw_path`: the
    request target as sent, when the server gives it (encoded slashes are refused).

    Raises DomainError: offering_not_found (no such active offering, or one that passes no
    path through), invalid_request (a path that would escape the prefix).
    """
    passes = Upstream.objects.filter(
        offering__slug=offering_slug,
        offering__is_active=True,
        kind=Upstream.Kind.HTTP,
        input_mode=Upstream.InputMode.REQUEST,
    ).exists()
    if not passes:
        raise DomainError(ErrorCode.OFFERING_NOT_FOUND, _NOT_PASSED)
    problem = passed_path_error(request.path.removeprefix("/"), raw_path)
    if problem is not None:
        raise DomainError(ErrorCode.INVALID_REQUEST, problem)
    return request_input(request)
