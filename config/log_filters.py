"""Logging filters the settings install (config.settings.base LOGGING).

Attached to the loggers whose records carry request paths, so every handler (console, mail,
an error tracker) sees the filtered record, not only ours.
"""

from __future__ import annotations

import logging
import re

# A purchase's capability status URL carries its secret in the path (as config.gunicorn
# redacts it from the access log).
_CAPABILITY = re.compile(r"(/x402/purchases/[^/\s?]+/)[^\s?\"']+")
REDACTED = r"\1[redacted]"


class RedactCapabilityTokens(logging.Filter):
    """Replace the token of any status URL in the message with `[redacted]`."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = _CAPABILITY.sub(REDACTED, message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True


class QuietPaymentRequired(logging.Filter):
    """Drop Django's "Payment Required" warning for the x402 paid URLs: there a 402 is the
    protocol's first step (every buyer's first call gets one), not a client error. Other
    4xx, and 402s elsewhere, stay warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        request = getattr(record, "request", None)
        path = getattr(request, "path", "")
        return not (getattr(record, "status_code", None) == 402 and path.startswith("/x402/"))
