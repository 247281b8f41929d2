"""One place to read the time, so services can take an injected `now`."""

from datetime import UTC, datetime

from django.utils import timezone


def now_or(value: datetime | None) -> datetime:
    return value if value is not None else timezone.now()


def utc_seconds(value: datetime | None) -> str:
    """A time to the second in UTC, e.g. 2026-12-01 03:04:05 UTC ("" for none)."""
    if value is None:
        return ""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
