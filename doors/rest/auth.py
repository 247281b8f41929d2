"""`Authorization: Bearer <api key>` for agents."""

from __future__ import annotations

from typing import Any

from rest_framework import authentication, exceptions, permissions
from rest_framework.request import Request

from purchases.models import Buyer
from purchases.services.shared.buyers import api_key_authenticate


class ApiKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[Buyer, str] | None:
        """(the buyer, the key's prefix as `request.auth`: what a per-key setting names)."""
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        scheme, _, raw_key = header.partition(" ")
        if scheme != self.keyword or not raw_key.strip():
            raise exceptions.AuthenticationFailed("Use 'Authorization: Bearer <api key>'.")
        buyer = api_key_authenticate(raw_key=raw_key.strip())
        if buyer is None:
            raise exceptions.AuthenticationFailed("Unknown or revoked API key.")
        return buyer, raw_key.strip().split("_", 2)[1]

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


class IsAgent(permissions.BasePermission):
    def has_permission(self, request: Request, view: Any) -> bool:
        return isinstance(request.user, Buyer)
