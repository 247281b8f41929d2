"""Production: every secret and service comes from the environment, and is refused if weak.

Each refusal raises ImproperlyConfigured at start-up, so a misconfigured deployment never
serves a request (docs/security.md lists them).
"""

import os

from django.core.exceptions import ImproperlyConfigured

from .base import *  # noqa: F403
from .base import ALLOWED_HOSTS, DATABASES, RECEIPTS, REDIS_URL, TOLLBOOTH_METRICS_TOKEN, env

DEBUG = False
# Webhooks go out over HTTPS only, whatever the environment says (docs/webhooks.md).
WEBHOOKS = {**WEBHOOKS, "REQUIRE_HTTPS": True}  # noqa: F405

# Django's own advice: 50 characters or more, and never the local default.
MIN_SECRET_KEY_LENGTH = 50
SECRET_KEY = env.str("DJANGO_SECRET_KEY", default="")
if len(SECRET_KEY) < MIN_SECRET_KEY_LENGTH or SECRET_KEY.startswith("insecure-"):
    raise ImproperlyConfigured(
        f"DJANGO_SECRET_KEY must be a random value of at least {MIN_SECRET_KEY_LENGTH} characters."
    )

# The embedded SQLite is for the demo only: production names its database.
if not os.environ.get("DATABASE_URL"):
    raise ImproperlyConfigured("DATABASE_URL is required in production (no embedded SQLite).")

# The filesystem broker and per-process throttle counters only work on one machine.
if not REDIS_URL:
    raise ImproperlyConfigured(
        "REDIS_URL is required in production (Celery broker and shared throttle counters)."
    )

if not os.environ.get("DJANGO_ALLOWED_HOSTS"):
    raise ImproperlyConfigured("DJANGO_ALLOWED_HOSTS is required in production.")
if {"testserver", "*"} & set(ALLOWED_HOSTS):
    raise ImproperlyConfigured("DJANGO_ALLOWED_HOSTS must name real hosts (no testserver, no *).")

# Receipts are signed with the seller's key from the environment, never a generated one.
if not RECEIPTS["KEY"]:
    raise ImproperlyConfigured(
        "TOLLBOOTH_RECEIPT_KEY is required in production (docs/receipts.md)."
    )

# Metrics show money owed and stuck payments: never open to the internet.
if not TOLLBOOTH_METRICS_TOKEN:
    raise ImproperlyConfigured("TOLLBOOTH_METRICS_TOKEN is required in production.")

# An active offering on a local development chain (anvil's 31337) is refused by a database
# system check (purchases/checks.py): `check --deploy --database default`, `migrate` and
# `make serve` stop with purchases.E001 instead of selling for a token anyone can mint.
# The one way out is named for what it is: the benches (`make bench`, `make bench-hosts`) run
# production's shape on anvil on purpose. A deployment never sets it.
X402_REFUSE_LOCAL_NETWORKS = not env.bool("TOLLBOOTH_BENCH_ALLOW_LOCAL_NETWORKS", default=False)

SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env.bool("DJANGO_SECURE_SSL_REDIRECT", default=True)
SECURE_HSTS_SECONDS = env.int("DJANGO_SECURE_HSTS_SECONDS", default=31_536_000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = True
SECURE_HSTS_PRELOAD = False  # preloading is a one-way door: the operator opts in by hand
SECURE_CONTENT_TYPE_NOSNIFF = True
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True

# Persistent connections, one per web thread and worker process, checked before reuse
# (docs/deployment.md says why not a pool). A database that does not answer a connect in
# a few seconds fails the request (and /readyz) instead of hanging a thread.
DATABASES["default"]["CONN_MAX_AGE"] = env.int("DJANGO_CONN_MAX_AGE", default=60)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
if DATABASES["default"]["ENGINE"].endswith("postgresql"):
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault("connect_timeout", 5)

# Hashed, compressed names from `collectstatic`, served by WhiteNoise with far-future caching.
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}
