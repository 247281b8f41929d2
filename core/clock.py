"""One place to read the time, so services can take an injected `now`."""

from datetime import datetime

from django.utils import timezone


def now_or(value: datetime | None) -> datetime:
    return value if value is not None else timezone.now()
