"""Rate limits on the paid URLs and quotes: per API key, and per client address.

Both limits of a request are decided together in one Redis round trip (core/rate_limit.py:
a sliding window per scope, checked and counted by one Lua script), in the default cache's
Redis when REDIS_URL is set, so every web process shares them; process memory otherwise.
Rates are read from settings at each request, so they can be changed by environment
(docs/security.md). A refusal is `429 throttled` with `Retry-After`.
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.http import HttpRequest
from rest_framework.request import Request
from rest_framework.throttling import BaseThrottle

from core.rate_limit import Window, parse_rate, rate_limit_hit
from purchases.models import Buyer


def client_address(request: HttpRequest) -> str:
    """The client's address: REMOTE_ADDR, or X-Forwarded-For past NUM_PROXIES trusted hops."""
    return BaseThrottle().get_ident(request)  # type: ignore[arg-type]


class PaidRequestThrottle(BaseThrottle):
    """Requests per API key (keyed requests) and per client address (every request, keyed or
    not; NUM_PROXIES says which hop to trust), settings' scopes `api_key` and
    `client_address`. A request refused by either is counted by neither."""

    # The clock, as DRF's throttles have it (a test may set its own).
    timer = staticmethod(time.time)

    def __init__(self) -> None:
        self.wait_seconds: float | None = None

    def windows(self, request: Request) -> list[Window]:
        rates = settings.TOLLBOOTH["THROTTLE_RATES"]
        scopes = [("client_address", self.get_ident(request))]
        if isinstance(request.user, Buyer):
            scopes.insert(0, ("api_key", request.user.ref))
        return [
            Window(f"{scope}:{ident}", *parse_rate(str(rates[scope]))) for scope, ident in scopes
        ]

    def allow_request(self, request: Request, view: Any) -> bool:
        decision = rate_limit_hit(windows=self.windows(request), now=self.timer())
        self.wait_seconds = None if decision.allowed else decision.wait
        return decision.allowed

    def wait(self) -> float | None:
        return self.wait_seconds


class RefundRequestThrottle(PaidRequestThrottle):
    """The paid requests' limits, and REFUND_REQUEST_RATE per purchase whoever sends them
    (accepted or refused): a signed path without a key must not become a free oracle nor a
    way to fill the queue."""

    purchase_ref = ""

    def allow_request(self, request: Request, view: Any) -> bool:
        self.purchase_ref = str(getattr(view, "kwargs", {}).get("ref", ""))[:64]
        return super().allow_request(request, view)

    def windows(self, request: Request) -> list[Window]:
        rate = str(settings.TOLLBOOTH["REFUND_REQUEST_RATE"])
        window = Window(f"refund_request:{self.purchase_ref}", *parse_rate(rate))
        return [*super().windows(request), window]


PAID_THROTTLES: list[type[BaseThrottle]] = [PaidRequestThrottle]
