"""Alerts for money owed and stuck states, sent through pluggable backends.

Call `alert_send` only after commit (from a task enqueued with `transaction.on_commit`, or
outside any `atomic()` block): backends do network I/O (SMTP, HTTP) and must never hold a
transaction or row lock open while they wait.

Delivery is at least once. A caller records "alerted" only after `alert_send` returns; on
`AlertNotDelivered` it leaves its row unmarked and a sweeper sends the alert again, so a
backend can see the same alert twice. `Alert.idempotency_key` (derived from our own ids)
lets a receiver drop the repeat.

Settings (read on every send, so tests and reloads see changes):
- TOLLBOOTH_ALERT_BACKENDS: short names ("log", "mail", "webhook") or dotted paths to a
  class with a `send(alert)` method. Unset or None: ["log", "mail"], plus "webhook" when
  TOLLBOOTH_ALERT_WEBHOOK_URL is set. An explicit list is used exactly as given.
- TOLLBOOTH_ALERT_WEBHOOK_URL: where WebhookBackend POSTs (default "").
- TOLLBOOTH_ALERT_WEBHOOK_TIMEOUT_SECONDS: connect and read timeout (default 5).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import requests
from django.conf import settings
from django.core.mail import mail_admins
from django.core.serializers.json import DjangoJSONEncoder
from django.utils.module_loading import import_string

logger = logging.getLogger(__name__)
# A separate logger, so operations can route alert lines without the module's diagnostics.
alert_logger = logging.getLogger("tollbooth.alerts")

DEFAULT_WEBHOOK_TIMEOUT_SECONDS = 5.0


class AlertNotDelivered(Exception):
    """No backend (or, raised by one backend, that backend) delivered the alert."""

    def __init__(self, message: str, report: AlertReport | None = None) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class AlertReport:
    """What one send did: the backends that delivered, those that failed (with why, short),
    and to whom each one goes (no secrets: a webhook is named by its host)."""

    delivered: list[str]
    failed: dict[str, str]
    recipients: dict[str, str]


@dataclass(frozen=True, kw_only=True)
class Alert:
    kind: str  # "refund_owed", "escalation_overdue", "settlement_unresolved", ...
    title: str
    message: str
    purchase_ref: str | None = None
    amount: int | None = None  # atomic units of `asset`; never a float
    asset: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    # Stable per thing alerted about (e.g. "tollbooth-refund-42"), so repeats are droppable.
    idempotency_key: str

    def as_payload(self) -> dict[str, Any]:
        return asdict(self)


class AlertBackend(Protocol):
    def send(self, alert: Alert) -> None:
        """Deliver the alert or raise (any exception counts as not delivered)."""


class LogBackend:
    def send(self, alert: Alert) -> None:
        # LogRecord reserves "message", so every structured field carries a prefix.
        extra = {f"alert_{key}": value for key, value in alert.as_payload().items()}
        alert_logger.warning(
            "alert %s: %s (purchase=%s key=%s)",
            alert.kind,
            alert.title,
            alert.purchase_ref,
            alert.idempotency_key,
            extra=extra,
        )


class MailAdminsBackend:
    def send(self, alert: Alert) -> None:
        # mail_admins silently sends nothing without ADMINS: that is not a delivery.
        if not settings.ADMINS:
            raise AlertNotDelivered("mail: settings.ADMINS is empty")
        mail_admins(f"[{alert.kind}] {alert.title}", _mail_body(alert), fail_silently=False)


class WebhookBackend:
    def send(self, alert: Alert) -> None:
        url = getattr(settings, "TOLLBOOTH_ALERT_WEBHOOK_URL", "")
        if not url:
            raise AlertNotDelivered("webhook: TOLLBOOTH_ALERT_WEBHOOK_URL is not set")
        timeout = float(
            getattr(
                settings, "TOLLBOOTH_ALERT_WEBHOOK_TIMEOUT_SECONDS", DEFAULT_WEBHOOK_TIMEOUT_SECONDS
            )
        )
        body = json.dumps(alert.as_payload(), cls=DjangoJSONEncoder)
        headers = {"Content-Type": "application/json", "Idempotency-Key": alert.idempotency_key}
        try:
            # A redirect is not an acknowledgement (and would turn the POST into a GET).
            response = requests.post(
                url, data=body, headers=headers, timeout=timeout, allow_redirects=False
            )
        except requests.RequestException as exc:
            raise AlertNotDelivered(f"webhook: {type(exc).__name__}") from exc
        if not 200 <= response.status_code < 300:
            raise AlertNotDelivered(f"webhook: HTTP {response.status_code}")


SHORT_NAMES: dict[str, type[AlertBackend]] = {
    "log": LogBackend,
    "mail": MailAdminsBackend,
    "webhook": WebhookBackend,
}


def alert_backend_names() -> list[str]:
    """The configured backends, after applying the default."""
    configured = getattr(settings, "TOLLBOOTH_ALERT_BACKENDS", None)
    if configured is not None:
        return list(configured)
    names = ["log", "mail"]
    if getattr(settings, "TOLLBOOTH_ALERT_WEBHOOK_URL", ""):
        names.append("webhook")
    return names


def _backend_load(name: str) -> AlertBackend:
    backend_class = SHORT_NAMES.get(name) or import_string(name)
    backend: AlertBackend = backend_class()
    return backend


def alert_send(alert: Alert) -> list[str]:
    """Send through every configured backend; return the names that delivered.

    Call after commit, never inside a transaction. One backend failing does not stop the
    others. Raises AlertNotDelivered when no backend that reaches a person delivered (the
    log counts only when it is the only backend), so the caller leaves its row unmarked for
    the sweeper.
    """
    return alert_send_report(alert).delivered


def alert_send_report(alert: Alert) -> AlertReport:
    """`alert_send`, saying which backends delivered, which failed and why, and to whom.
    Raises AlertNotDelivered (carrying the report) as `alert_send` does."""
    delivered: list[str] = []
    failed: dict[str, str] = {}
    names = alert_backend_names()
    for name in names:
        try:
            _backend_load(name).send(alert)
        except Exception as exc:
            # Anticipated or not, a broken channel must not silence the others.
            logger.exception("alert %s via %s failed", alert.idempotency_key, name)
            failed[name] = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
            continue
        delivered.append(name)
    report = AlertReport(delivered, failed, {name: _recipient(name) for name in names})
    # A log line reaches no person: when any other channel is configured, one of those must
    # deliver, or the caller keeps its row unmarked and the sweeper tries again.
    reaching_people = [n for n in names if n != "log"]
    if not delivered or (reaching_people and not set(delivered) & set(reaching_people)):
        raise AlertNotDelivered(
            f"alert {alert.idempotency_key}: no backend reached a person", report
        )
    return report


ERROR_CHARS = 200  # what of a backend's error goes on the timeline


def _recipient(name: str) -> str:
    """To whom a backend sends, as the timeline may show it."""
    if name == "log":
        return f"log {alert_logger.name}"
    if name == "mail":
        return ", ".join(email for _, email in settings.ADMINS) or "(no ADMINS)"
    if name == "webhook":
        url = getattr(settings, "TOLLBOOTH_ALERT_WEBHOOK_URL", "")
        return urlsplit(url).netloc or "(no URL)"  # the host only: paths may carry tokens
    return name


def _mail_body(alert: Alert) -> str:
    lines = [alert.message, ""]
    if alert.purchase_ref:
        lines.append(f"Purchase: {alert.purchase_ref}")
    if alert.amount is not None:
        lines.append(f"Amount: {alert.amount} (atomic units of {alert.asset})")
    for key, value in sorted(alert.details.items()):
        lines.append(f"{key}: {value}")
    lines.append(f"Alert key: {alert.idempotency_key}")
    return "\n".join(lines)
