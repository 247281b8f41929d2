"""Rate limits on the paid URLs and quotes: per API key, and per client address.

Counters live in Django's cache (Redis when REDIS_URL is set, so every web process shares
them). Rates are read from settings at each request, so they can be changed by environment
(docs/security.md). A refusal is `429 throttled` with `Retry-After`.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest
from rest_framework.request import Request
from rest_framework.throttling import BaseThrottle, SimpleRateThrottle

from purchases.models import Buyer


def client_address(request: HttpRequest) -> str:
    """The client's address: REMOTE_ADDR, or X-Forwarded-For past NUM_PROXIES trusted hops."""
    return BaseThrottle().get_ident(request)  # type: ignore[arg-type]


class _SettingsRateThrottle(SimpleRateThrottle):
    def get_rate(self) -> str | None:
        return str(settings.TOLLBOOTH["THROTTLE_RATES"][self.scope])

    def allow_request(self, request: Request, view: Any) -> bool:
        # Rates are re-read per request (settings may change them); DRF parses once in __init__.
        self.rate = self.get_rate()
        self.num_requests, self.duration = self.parse_rate(self.rate)
        return super().allow_request(request, view)


class ApiKeyThrottle(_SettingsRateThrottle):
    """Requests per API key (buyer); anonymous requests are left to the address limit."""

    scope = "api_key"

    def get_cache_key(self, request: Request, view: Any) -> str | None:
        if not isinstance(request.user, Buyer):
            return None
        return self.cache_format % {"scope": self.scope, "ident": request.user.ref}


class ClientAddressThrottle(_SettingsRateThrottle):
    """Requests per client address, keyed or not (NUM_PROXIES says which hop to trust)."""

    scope = "client_address"

    def get_cache_key(self, request: Request, view: Any) -> str | None:
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}


PAID_THROTTLES: list[type[SimpleRateThrottle]] = [ApiKeyThrottle, ClientAddressThrottle]
