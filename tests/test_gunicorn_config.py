"""The production server's configuration (config/gunicorn.py)."""

from __future__ import annotations

from types import SimpleNamespace

import config.gunicorn as conf


def test_timeouts_outlast_the_longest_paid_request(settings):
    settings.X402_RESULT_WAIT_SECONDS = 10.0
    longest = conf.longest_paid_wait_seconds()
    slowest_confirmation = max(n["confirmation_timeout"] for n in settings.X402_NETWORKS.values())
    assert longest >= slowest_confirmation + 10.0
    assert conf.timeout > longest and conf.graceful_timeout >= conf.timeout
    assert conf.worker_class == "gthread" and conf.threads >= 2
    # Replicas on one host must not share gunicorn 27's per-user control socket.
    assert conf.control_socket_disable is True and conf.preload_app is False


def test_access_log_redacts_capability_tokens():
    environ = {
        "REQUEST_METHOD": "GET",
        "RAW_URI": "/x402/purchases/pur_abc/s3cret-token",
        "PATH_INFO": "/x402/purchases/pur_abc/s3cret-token",
        "QUERY_STRING": "",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": "127.0.0.1",
    }
    logger = conf.RedactingLogger(SimpleNamespace(**_logger_cfg()))
    response = SimpleNamespace(status="200 OK", sent=10, headers=[], response_length=10)
    request = SimpleNamespace(headers=[])
    atoms = logger.atoms(response, request, environ, _Elapsed())
    assert "s3cret" not in atoms["r"] and "s3cret" not in atoms["U"]
    assert atoms["U"] == "/x402/purchases/pur_abc/[redacted]"


class _Elapsed:
    seconds, microseconds = 0, 1500

    def total_seconds(self) -> float:
        return 0.0015


def _logger_cfg() -> dict[str, object]:
    return {
        "errorlog": "-",
        "accesslog": None,
        "loglevel": "info",
        "syslog": False,
        "logconfig": None,
        "logconfig_dict": {},
        "logconfig_json": None,
        "capture_output": False,
        "user": 0,
        "group": 0,
        "access_log_format": conf.access_log_format,
        "disable_redirect_access_to_syslog": True,
        "statsd_host": None,
        "dogstatsd_tags": "",
        "statsd_prefix": "",
        "syslog_addr": None,
    }
