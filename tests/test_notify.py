"""Alerts through real channels: a local HTTP server as the webhook, the locmem mail outbox."""

from __future__ import annotations

import json
import logging
import socket
import threading
from typing import Any

import pytest

from purchases.notify import (
    Alert,
    AlertNotDelivered,
    LogBackend,
    WebhookBackend,
    alert_backend_names,
    alert_send,
)

ALERT = Alert(
    kind="refund_owed",
    title="Refund owed: 250000 of USDC",
    message="Purchase pur_test paid after it failed.",
    purchase_ref="pur_test",
    amount=250_000,
    asset="0xa0a0",
    details={"refund": 42, "transaction": "0xfeed"},
    idempotency_key="tollbooth-refund-42",
)


@pytest.fixture
def admins(settings: Any) -> Any:
    settings.ADMINS = [("Finance", "finance@example.com"), ("Ops", "ops@example.com")]
    settings.EMAIL_SUBJECT_PREFIX = "[tollbooth] "
    return settings


class RecordingBackend:
    sent: list[Alert] = []

    def send(self, alert: Alert) -> None:
        RecordingBackend.sent.append(alert)


class BrokenBackend:
    def send(self, alert: Alert) -> None:
        raise RuntimeError("unanticipated")


def test_webhook_receives_the_alert_as_json_with_its_idempotency_key(settings, webhook):
    settings.TOLLBOOTH_ALERT_BACKENDS = ["webhook"]
    settings.TOLLBOOTH_ALERT_WEBHOOK_URL = webhook.url

    assert alert_send(ALERT) == ["webhook"]

    assert len(webhook.received) == 1
    request = webhook.received[0]
    assert (request.method, request.path) == ("POST", "/hooks/tollbooth")
    assert request.headers["Idempotency-Key"] == "tollbooth-refund-42"
    assert request.headers["Content-Type"] == "application/json"
    payload = json.loads(request.body)
    assert payload == {
        "kind": "refund_owed",
        "title": "Refund owed: 250000 of USDC",
        "message": "Purchase pur_test paid after it failed.",
        "purchase_ref": "pur_test",
        "amount": 250_000,
        "asset": "0xa0a0",
        "details": {"refund": 42, "transaction": "0xfeed"},
        "idempotency_key": "tollbooth-refund-42",
    }
    assert type(payload["amount"]) is int


def test_defaults_are_log_and_mail_plus_webhook_when_its_url_is_set(
    settings, admins, webhook, mailoutbox, caplog
):
    del settings.TOLLBOOTH_ALERT_BACKENDS
    settings.TOLLBOOTH_ALERT_WEBHOOK_URL = ""
    assert alert_backend_names() == ["log", "mail"]

    settings.TOLLBOOTH_ALERT_WEBHOOK_URL = webhook.url
    with caplog.at_level(logging.WARNING, logger="tollbooth.alerts"):
        assert alert_send(ALERT) == ["log", "mail", "webhook"]

    assert len(webhook.received) == 1
    assert len(mailoutbox) == 1
    [record] = [r for r in caplog.records if r.name == "tollbooth.alerts"]
    assert record.levelno == logging.WARNING
    assert record.alert_kind == "refund_owed"  # type: ignore[attr-defined]
    assert record.alert_amount == 250_000  # type: ignore[attr-defined]
    assert record.alert_idempotency_key == "tollbooth-refund-42"  # type: ignore[attr-defined]


def test_mail_goes_to_the_admins_with_the_evidence(settings, admins, mailoutbox):
    settings.TOLLBOOTH_ALERT_BACKENDS = ["mail"]

    assert alert_send(ALERT) == ["mail"]

    [mail] = mailoutbox
    assert mail.subject == "[tollbooth] [refund_owed] Refund owed: 250000 of USDC"
    assert mail.to == ["finance@example.com", "ops@example.com"]
    assert mail.body.splitlines() == [
        "Purchase pur_test paid after it failed.",
        "",
        "Purchase: pur_test",
        "Amount: 250000 (atomic units of 0xa0a0)",
        "refund: 42",
        "transaction: 0xfeed",
        "Alert key: tollbooth-refund-42",
    ]


def test_a_failing_webhook_does_not_stop_mail_and_log(
    settings, admins, webhook, mailoutbox, caplog
):
    webhook.status = 500
    settings.TOLLBOOTH_ALERT_BACKENDS = ["log", "webhook", "mail"]
    settings.TOLLBOOTH_ALERT_WEBHOOK_URL = webhook.url

    assert alert_send(ALERT) == ["log", "mail"]

    assert len(webhook.received) == 1  # tried once, not retried inline
    assert len(mailoutbox) == 1
    failures = [r for r in caplog.records if r.name == "purchases.notify"]
    assert [r.getMessage() for r in failures] == ["alert tollbooth-refund-42 via webhook failed"]
    assert failures[0].exc_info is not None
    assert "HTTP 500" in str(failures[0].exc_info[1])


def test_all_backends_failing_raises_so_the_caller_keeps_its_row_unmarked(
    settings, webhook, mailoutbox
):
    webhook.status = 503
    settings.ADMINS = []  # mail_admins would "succeed" by sending nothing
    settings.TOLLBOOTH_ALERT_BACKENDS = ["mail", "webhook", "tests.test_notify.BrokenBackend"]
    settings.TOLLBOOTH_ALERT_WEBHOOK_URL = webhook.url

    with pytest.raises(AlertNotDelivered):
        alert_send(ALERT)

    assert mailoutbox == []
    assert len(webhook.received) == 1


def test_no_backend_configured_is_not_a_delivery(settings):
    settings.TOLLBOOTH_ALERT_BACKENDS = []

    with pytest.raises(AlertNotDelivered):
        alert_send(ALERT)


def test_a_dotted_path_backend_is_loaded_and_named_by_its_path(settings):
    RecordingBackend.sent.clear()
    settings.TOLLBOOTH_ALERT_BACKENDS = ["tests.test_notify.RecordingBackend", "log"]

    assert alert_send(ALERT) == ["tests.test_notify.RecordingBackend", "log"]
    assert RecordingBackend.sent == [ALERT]


def test_webhook_network_error_is_not_delivered(settings):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    settings.TOLLBOOTH_ALERT_WEBHOOK_URL = f"http://127.0.0.1:{closed_port}/"

    with pytest.raises(AlertNotDelivered, match="ConnectionError"):
        WebhookBackend().send(ALERT)


def test_webhook_timeout_comes_from_the_setting(settings, webhook):
    webhook.hold = threading.Event()
    settings.TOLLBOOTH_ALERT_WEBHOOK_URL = webhook.url
    settings.TOLLBOOTH_ALERT_WEBHOOK_TIMEOUT_SECONDS = 0.2

    with pytest.raises(AlertNotDelivered, match="ReadTimeout"):
        WebhookBackend().send(ALERT)
    assert len(webhook.received) == 1


def test_a_redirect_is_not_an_acknowledgement(settings, webhook):
    webhook.status = 302
    settings.TOLLBOOTH_ALERT_WEBHOOK_URL = webhook.url

    with pytest.raises(AlertNotDelivered, match="HTTP 302"):
        WebhookBackend().send(ALERT)
    assert [r.path for r in webhook.received] == ["/hooks/tollbooth"]


def test_webhook_without_url_is_not_delivered(settings):
    settings.TOLLBOOTH_ALERT_WEBHOOK_URL = ""

    with pytest.raises(AlertNotDelivered, match="not set"):
        WebhookBackend().send(ALERT)


def test_log_backend_never_collides_with_logrecord_fields(caplog):
    with caplog.at_level(logging.WARNING, logger="tollbooth.alerts"):
        LogBackend().send(ALERT)

    [record] = caplog.records
    assert record.getMessage() == (
        "alert refund_owed: Refund owed: 250000 of USDC (purchase=pur_test key=tollbooth-refund-42)"
    )
    assert record.alert_message == ALERT.message  # type: ignore[attr-defined]
