"""Tests: PostgreSQL and Redis when DATABASE_URL / REDIS_URL are set (always in CI)."""

from datetime import timedelta

from .base import *  # noqa: F403
from .base import DATABASES, TOLLBOOTH, env

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    DATABASES["default"]["TEST"] = {"NAME": ":memory:"}
TOLLBOOTH = {
    **TOLLBOOTH,
    "EXECUTION_LEASE": timedelta(seconds=env.int("TOLLBOOTH_EXECUTION_LEASE_SECONDS", default=30)),
    "EXECUTION_POLL_INTERVAL": env.float("TOLLBOOTH_EXECUTION_POLL_SECONDS", default=0.05),
}
EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
