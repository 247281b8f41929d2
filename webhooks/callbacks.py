"""A buyer's callback URL, one per API key (docs/webhooks.md, "A buyer's callback URL"): set,
read and cleared through the API with that key. It is a WebhookEndpoint with `api_key` set,
so it is delivered, retried, signed, watched and shown in the admin as the admins' are; it
hears of its buyer's purchases only (webhooks.services._hears_of).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from core.clock import now_or
from core.errors import DomainError, ErrorCode
from purchases.models import ApiKey
from webhooks.models import WebhookDelivery, WebhookEndpoint
from webhooks.signing import callback_secret
from webhooks.urlguard import UrlRefused, url_check


@dataclass(frozen=True)
class Callback:
    url: str
    key_id: str
    event_types: list[str]
    enabled: bool
    disabled_reason: str
    updated_at: datetime
    # Only in the answer that set it: shown once, never again.
    secret: str | None = None

    def as_document(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "url": self.url,
            "key_id": self.key_id,
            "event_types": self.event_types,
            "enabled": self.enabled,
            "disabled_reason": self.disabled_reason,
            "updated_at": self.updated_at.isoformat(),
        }
        if self.secret is not None:
            document["secret"] = self.secret
        return document


def _of(endpoint: WebhookEndpoint, secret: str | None = None) -> Callback:
    return Callback(
        url=endpoint.url,
        key_id=endpoint.key_id,
        event_types=list(endpoint.event_types or []),
        enabled=endpoint.enabled,
        disabled_reason=endpoint.disabled_reason,
        updated_at=endpoint.updated_at,
        secret=secret,
    )


def webhook_callback_set(
    *, api_key_prefix: str, url: str, event_types: list[str] | None = None, now: Any = None
) -> Callback:
    """Set (or replace) the key's callback URL, with a new secret and key id returned once,
    enabled; its pending deliveries are due at once (to the new URL, under the new secret).
    Raises DomainError `callback_url_invalid` (a URL the guard refuses, `reason` in extra)
    or `invalid_request` (unknown event types)."""
    try:
        url_check(url)
    except UrlRefused as refused:
        raise DomainError(
            ErrorCode.CALLBACK_URL_INVALID, refused.message, extra={"reason": refused.reason}
        ) from refused
    now = now_or(now)
    with transaction.atomic():
        key = ApiKey.objects.select_for_update().select_related("buyer").get(prefix=api_key_prefix)
        endpoint = WebhookEndpoint.objects.filter(api_key=key).first() or WebhookEndpoint(
            api_key=key
        )
        endpoint.url = url
        endpoint.event_types = event_types or []
        endpoint.description = f"callback of {key.buyer.ref} (key {key.prefix})"
        endpoint.secret_env, endpoint.previous_secret_env, endpoint.previous_key_id = "", "", ""
        endpoint.secret_salt = secrets.token_hex(16)
        endpoint.key_id = f"cb_{secrets.token_hex(4)}"
        endpoint.enabled, endpoint.disabled_reason, endpoint.disabled_at = True, "", None
        try:
            endpoint.full_clean(exclude=["api_key"])
        except ValidationError as invalid:
            raise DomainError(
                ErrorCode.INVALID_REQUEST,
                "The callback is invalid.",
                extra={"errors": invalid.message_dict},
            ) from invalid
        endpoint.save()
        WebhookDelivery.objects.filter(
            endpoint=endpoint, state=WebhookDelivery.State.PENDING
        ).update(next_attempt_at=now)
    return _of(endpoint, secret=callback_secret(endpoint.secret_salt))


def webhook_callback_get(*, api_key_prefix: str) -> Callback:
    """The key's callback (never its secret). Raises DomainError `callback_not_set`."""
    endpoint = WebhookEndpoint.objects.filter(api_key__prefix=api_key_prefix).first()
    if endpoint is None:
        raise DomainError(ErrorCode.CALLBACK_NOT_SET)
    return _of(endpoint)


def webhook_callback_clear(*, api_key_prefix: str) -> None:
    """Remove the key's callback URL and whatever it had not yet been sent. Raises
    DomainError `callback_not_set`."""
    with transaction.atomic():
        deleted, _ = WebhookEndpoint.objects.filter(api_key__prefix=api_key_prefix).delete()
    if not deleted:
        raise DomainError(ErrorCode.CALLBACK_NOT_SET)


__all__ = ["Callback", "webhook_callback_clear", "webhook_callback_get", "webhook_callback_set"]
