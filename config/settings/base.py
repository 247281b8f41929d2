"""Settings shared by every environment. The environment is read here and nowhere else."""

from datetime import timedelta
from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent.parent
VAR_DIR = Path(environ.Env().str("TOLLBOOTH_VAR_DIR", default=str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)

env = environ.Env()

SECRET_KEY = env.str("DJANGO_SECRET_KEY", default="insecure-local-only-key")
DEBUG = env.bool("DJANGO_DEBUG", default=False)
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "testserver"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "corsheaders",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "axes",
    "purchases",
    "payments",
    "fulfillment",
    # Above the apps: every app's admin, the roles, the books (no models).
    "backoffice",
    "webhooks",
]

MIDDLEWARE = [
    # First: load-balancer probes are answered before host checks and the HTTPS redirect.
    "config.health.HealthCheckMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Static files (the admin's) from the app itself: no other web server needed.
    "config.static_files.StaticFilesMiddleware",
    # Outside the hostile-input check, so its refusals (problems) are not cached either.
    "doors.rest.middleware.NoStoreMiddleware",
    "doors.rest.middleware.HostileInputMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "corsheaders.middleware.CorsMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes asks: it answers a locked-out login.
    "axes.middleware.AxesMiddleware",
]

# Browser agents may buy from any origin: the paid URLs, the capability status URLs and
# discovery answer CORS (API-key endpoints and the admin do not). Payment headers are
# readable by scripts; no cookies are involved.
CORS_URLS_REGEX = r"^/(x402/|\.well-known/(x402|tollbooth-receipts)$)"
CORS_ALLOW_ALL_ORIGINS = True
CORS_ALLOW_CREDENTIALS = False
CORS_ALLOW_METHODS = ["GET", "HEAD", "OPTIONS", "POST"]
CORS_ALLOW_HEADERS = [
    "accept",
    "authorization",
    "content-type",
    "payment-signature",
    "x-payment",
    "tollbooth-copy",
    # The official x402 clients send this as a request header on the paid retry.
    "access-control-expose-headers",
]
CORS_EXPOSE_HEADERS = [
    "PAYMENT-REQUIRED",
    "PAYMENT-RESPONSE",
    "Retry-After",
    "Location",
    "Link",
    "Repr-Digest",
    "Tollbooth-Duplicate-Of",
    "Tollbooth-Receipt",
]
CORS_PREFLIGHT_MAX_AGE = 600

# Admin logins go through django-axes first, which counts failures and refuses a locked
# out (username, address) pair before the password is even checked. Then Django's
# ModelBackend, reading a signed-in user with their groups and permissions in one query
# (core.auth): a support or finance page costs no more queries than a superuser's.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "core.auth.StaffGrantsBackend",
]
# After this many failed logins for one username from one address, that pair is locked out
# for AXES_COOLOFF_TIME. Per pair, so an attacker cannot lock support out from everywhere.
AXES_FAILURE_LIMIT = env.int("TOLLBOOTH_ADMIN_LOGIN_FAILURE_LIMIT", default=5)
AXES_COOLOFF_TIME = timedelta(minutes=env.int("TOLLBOOTH_ADMIN_LOCKOUT_MINUTES", default=30))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
# The same address rule as the API throttles: REMOTE_ADDR unless proxies are trusted.
AXES_CLIENT_IP_CALLABLE = "doors.rest.throttles.client_address"

# config/asgi.py names config.urls_asgi: the same site, the x402 paid URL served async.
ROOT_URLCONF = env("TOLLBOOTH_ROOT_URLCONF", default="config.urls")
WSGI_APPLICATION = "config.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# SQLite is the embedded default for the demo; DATABASE_URL selects PostgreSQL.
DATABASES = {
    "default": env.db("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'tollbooth.sqlite3'}"),
}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # The demo runs a threaded web server and a worker on one file. A DEFERRED transaction
    # that reads and then writes cannot wait for the lock (SQLite answers "database is
    # locked" at once to avoid a deadlock), so every transaction takes the write lock at
    # BEGIN and a contended writer waits up to the busy timeout. WAL lets readers go on
    # while one writer writes; synchronous=NORMAL is the safe setting under WAL.
    _busy_seconds = env.float("TOLLBOOTH_SQLITE_BUSY_TIMEOUT_SECONDS", default=20.0)
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "transaction_mode": "IMMEDIATE",
            "timeout": _busy_seconds,
            "init_command": (
                "PRAGMA journal_mode=WAL;"
                f"PRAGMA busy_timeout={int(_busy_seconds * 1000)};"
                "PRAGMA synchronous=NORMAL;"
            ),
        }
    )
# Services own their transactions (house style).
DATABASES["default"]["ATOMIC_REQUESTS"] = False
# Behind a transaction-pooling PgBouncer a server-side cursor (a streamed export) may find
# its next FETCH on another server connection: say so with DATABASE_DISABLE_SERVER_SIDE_CURSORS
# or `?disable_server_side_cursors=true` on DATABASE_URL (docs/deployment.md). The URL's value
# arrives as a string ("false" would be truthy), so both are read as booleans here.
DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = env.bool(
    "DATABASE_DISABLE_SERVER_SIDE_CURSORS",
    default=str(DATABASES["default"].get("DISABLE_SERVER_SIDE_CURSORS", False)).lower()
    in {"true", "1", "yes", "on"},
)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
# Admin times to the second with their zone (config/formats/en/formats.py).
FORMAT_MODULE_PATH = ["config.formats"]
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"  # `collectstatic` fills it; WhiteNoise serves it
STATIC_ROOT.mkdir(exist_ok=True)

REDIS_URL = env.str("REDIS_URL", default="")

# /readyz reuses a result this long, so a flood of probes is not a flood of RPC calls.
TOLLBOOTH_READINESS_CACHE_SECONDS = env.float("TOLLBOOTH_READINESS_CACHE_SECONDS", default=2.0)

# --- REST API -------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["doors.rest.auth.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["doors.rest.auth.IsAgent"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    # Bounded in size and depth before decoding; NUL and lone surrogates refused (docs/security.md).
    "DEFAULT_PARSER_CLASSES": ["doors.rest.parsers.BoundedJSONParser"],
    "EXCEPTION_HANDLER": "doors.rest.problems.problem_exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
    # The client address is REMOTE_ADDR unless we sit behind this many trusted proxies, whose
    # X-Forwarded-For then names it. Never trust a client-supplied X-Forwarded-For by default.
    "NUM_PROXIES": env.int("TOLLBOOTH_TRUSTED_PROXIES", default=0),
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Tollbooth agent API",
    "DESCRIPTION": "Quotes, purchases, results and receipts for AI agents. See docs/api.md.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # Served from the sidecar package: the docs page works with no CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    # The API-key auth and the problem+json errors every operation can answer.
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "doors.rest.schema.problem_responses_hook",
    ],
}

# Throttle counters (doors/rest/throttles.py) must be shared by every web process: Redis
# when REDIS_URL is set, else the process-local memory cache of the embedded demo.
CACHES = {
    "default": (
        {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": "tollbooth",
            # A Redis that stops answering (host gone, packets dropped) must cost a request
            # well under a second before throttling falls back to process memory
            # (core/rate_limit.py), never the kernel's minutes-long connect timeout.
            "OPTIONS": {
                "socket_connect_timeout": env.float(
                    "TOLLBOOTH_REDIS_CONNECT_TIMEOUT_SECONDS", default=0.5
                ),
                "socket_timeout": env.float("TOLLBOOTH_REDIS_TIMEOUT_SECONDS", default=1.0),
            },
        }
        if REDIS_URL
        else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    )
}

# --- Celery -----------------------------------------------------------------------
# Redis when REDIS_URL is set; otherwise kombu's filesystem transport, which needs no server.
# A hostname, though the filesystem transport ignores it: kombu warns "No hostname was
# supplied" on every connection without one.
CELERY_BROKER_URL = REDIS_URL or "filesystem://localhost/"
if not REDIS_URL:
    _broker_dir = VAR_DIR / "broker"
    # The control folder too: left unset, kombu writes it into the working directory.
    for _folder in ("data", "control"):
        (_broker_dir / _folder).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "data"),
        "data_folder_out": str(_broker_dir / "data"),
        "control_folder": str(_broker_dir / "control"),
    }
# Every web replica and worker of one deployment must agree on it (docs/deployment.md).
CELERY_TASK_DEFAULT_QUEUE = env.str("TOLLBOOTH_CELERY_QUEUE", default="celery")
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_TIME_LIMIT = 15 * 60
CELERY_TASK_SOFT_TIME_LIMIT = 14 * 60
CELERY_TASK_IGNORE_RESULT = True
CELERY_TIMEZONE = "UTC"
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")

# --- Tollbooth domain -------------------------------------------------------------
# Largest request body read (bytes). It holds the largest honest input (a report's CSV of
# 1,000,000 characters, JSON-escaped) and bounds what one request can make us read.
MAX_BODY_BYTES = env.int("TOLLBOOTH_MAX_BODY_BYTES", default=2_621_440)
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_BODY_BYTES
TOLLBOOTH = {
    "MAX_BODY_BYTES": MAX_BODY_BYTES,
    # MCP tool calls run their (synchronous) domain call in worker threads: at most this many
    # at once per ASGI worker process; a paying call holds one while it waits (docs/mcp.md).
    "MCP_THREADS": env.int("TOLLBOOTH_MCP_THREADS", default=16),
    # The x402 paid URL on the ASGI app runs its synchronous parts (record and broadcast;
    # record the outcome and answer) in at most this many threads per worker process; its
    # wait for the block holds none (doors/x402/paid_async.py, docs/deployment.md).
    "X402_THREADS": env.int("TOLLBOOTH_X402_THREADS", default=8),
    # Paid URLs and quotes (429 throttled + Retry-After past these). An agent polls a result
    # every 2 s; quoting and paying take a few calls per purchase.
    "THROTTLE_RATES": {
        "api_key": env.str("TOLLBOOTH_THROTTLE_API_KEY_RATE", default="120/min"),
        "client_address": env.str("TOLLBOOTH_THROTTLE_ADDRESS_RATE", default="120/min"),
    },
    # How long a quote stays open (domain default: 15 minutes).
    "QUOTE_TTL": timedelta(seconds=env.int("TOLLBOOTH_QUOTE_TTL_SECONDS", default=15 * 60)),
    # Expired quotes that never got a purchase are deleted (with their own events) this
    # long after they expired: long enough for support to see why a late payer was refused.
    "QUOTE_PURGE_AFTER": timedelta(hours=env.int("TOLLBOOTH_QUOTE_PURGE_AFTER_HOURS", default=24)),
    # How long a payment-id record answers replays before it is compacted.
    "IDEMPOTENCY_RETENTION": timedelta(
        hours=env.int("TOLLBOOTH_IDEMPOTENCY_RETENTION_HOURS", default=24)
    ),
    # The most a request may hold a payment id, however alive its process: a request hung
    # this long is presumed stuck and the next retry takes over. Longer than the slowest
    # x402 wait (confirmation timeout + result wait), so a working request is never taken
    # over. A holder that died is recognised much sooner (IDEMPOTENCY_HEARTBEAT).
    "IDEMPOTENCY_LEASE": timedelta(
        seconds=env.int("TOLLBOOTH_IDEMPOTENCY_LEASE_SECONDS", default=120)
    ),
    # A process renews the leases its live requests hold this often (one UPDATE for all of
    # them, from a thread of its own); a lease not renewed for 4 beats is its dead holder's
    # and the next retry takes it over (purchases/services/checkout/leases.py).
    "IDEMPOTENCY_HEARTBEAT": timedelta(
        seconds=env.float("TOLLBOOTH_IDEMPOTENCY_HEARTBEAT_SECONDS", default=2.0)
    ),
    # Seconds an agent is told to wait before polling again.
    "RETRY_AFTER_SECONDS": env.int("TOLLBOOTH_RETRY_AFTER_SECONDS", default=2),
    # Retry-After on `503 service_unavailable` (the database or broker unreachable): long
    # enough that a fleet of agents does not hammer a recovering database, short enough
    # that a blip costs a buyer seconds.
    "UNAVAILABLE_RETRY_AFTER_SECONDS": env.int(
        "TOLLBOOTH_UNAVAILABLE_RETRY_AFTER_SECONDS", default=5
    ),
    # A worker must renew its claim on an execution within this lease.
    "EXECUTION_LEASE": timedelta(seconds=env.int("TOLLBOOTH_EXECUTION_LEASE_SECONDS", default=60)),
    # An execution whose executor cannot say what happened is tried this many times in all
    # (counted in the database, across retries, sweeps and worker restarts), and no longer
    # than the deadline from its first try; then it escalates to support as unknown.
    "EXECUTION_MAX_TRIES": env.int("TOLLBOOTH_EXECUTION_MAX_TRIES", default=8),
    "EXECUTION_DEADLINE": timedelta(
        minutes=env.int("TOLLBOOTH_EXECUTION_DEADLINE_MINUTES", default=120)
    ),
    # First retry delay; it doubles per try up to 10 minutes (8 tries span about 8.5 min).
    "EXECUTION_RETRY_BACKOFF_SECONDS": env.float(
        "TOLLBOOTH_EXECUTION_RETRY_BACKOFF_SECONDS", default=2.0
    ),
    # An execution that ended unknown (tries or deadline spent) keeps being checked: its job
    # is asked again after this many seconds, the wait doubling per check up to the cap. The
    # job service keys jobs by our idempotency key, so a check never starts a second job.
    "EXECUTION_RECHECK_SECONDS": env.float("TOLLBOOTH_EXECUTION_RECHECK_SECONDS", default=60.0),
    "EXECUTION_RECHECK_MAX_SECONDS": env.float(
        "TOLLBOOTH_EXECUTION_RECHECK_MAX_SECONDS", default=1800.0
    ),
    # How often a running execution polls its executor (and renews its lease).
    "EXECUTION_POLL_INTERVAL": env.float("TOLLBOOTH_EXECUTION_POLL_SECONDS", default=0.5),
    # Prepaid top-ups over x402 (docs/x402.md#top-ups): the smallest and largest amount one
    # top-up may credit, in the asset's atomic units (USDC: 0.10 and 500.00). x402 pays
    # exactly what a 402 offers, so every amount inside these is a quote of its own.
    "TOP_UP_MIN": env.int("TOLLBOOTH_TOP_UP_MIN_ATOMIC", default=100_000),
    "TOP_UP_MAX": env.int("TOLLBOOTH_TOP_UP_MAX_ATOMIC", default=500_000_000),
    # Spend caps count payments over this rolling window.
    "SPEND_CAP_WINDOW": timedelta(hours=env.int("TOLLBOOTH_SPEND_CAP_WINDOW_HOURS", default=24)),
    # Rows waiting on a task longer than this are re-enqueued by the sweeper.
    "SWEEP_GRACE": timedelta(seconds=env.int("TOLLBOOTH_SWEEP_GRACE_SECONDS", default=60)),
    # A staged job belongs to the immediate relay (run right after its commit) this long;
    # then the relay loop sends it too, so a process that died after the commit costs this
    # much latency at most, and a healthy relay is never raced by the loop.
    "OUTBOX_RELAY_GRACE": timedelta(
        seconds=env.float("TOLLBOOTH_OUTBOX_RELAY_GRACE_SECONDS", default=10.0)
    ),
    # Relayed outbox messages are kept this long (what was sent, when, after how many tries).
    "OUTBOX_RETENTION": timedelta(hours=env.int("TOLLBOOTH_OUTBOX_RETENTION_HOURS", default=72)),
    # A dispute evidence pack says it is kept this long (its `keepUntil`): apart from the
    # result's retention, since it holds the result's SHA-256, not its bytes (docs/evidence.md).
    "EVIDENCE_RETENTION": timedelta(
        days=env.int("TOLLBOOTH_EVIDENCE_RETENTION_DAYS", default=7 * 365 + 2)
    ),
    # Escalations are due this long after they are opened.
    "ESCALATION_DEADLINE": timedelta(
        hours=env.int("TOLLBOOTH_ESCALATION_DEADLINE_HOURS", default=4)
    ),
    # A buyer's refund request is due for a staff decision this long after it is opened.
    "REFUND_REQUEST_DEADLINE": timedelta(
        hours=env.int("TOLLBOOTH_REFUND_REQUEST_DEADLINE_HOURS", default=48)
    ),
    # Refund requests one purchase may send (accepted or refused) per window.
    "REFUND_REQUEST_RATE": env.str("TOLLBOOTH_REFUND_REQUEST_RATE", default="10/hour"),
    # A wallet-signed refund request's `expiry` may be at most this far ahead.
    "REFUND_REQUEST_MAX_VALIDITY": timedelta(
        seconds=env.int("TOLLBOOTH_REFUND_REQUEST_MAX_VALIDITY_SECONDS", default=3600)
    ),
    # Reconciliation: a settlement nobody can resolve goes to the reconciliation owner after
    # RECONCILIATION_DEADLINE and to support after SUPPORT_DEADLINE.
    "RECONCILIATION_DEADLINE": timedelta(
        hours=env.int("TOLLBOOTH_RECONCILIATION_DEADLINE_HOURS", default=6)
    ),
    "SUPPORT_DEADLINE": timedelta(hours=env.int("TOLLBOOTH_SUPPORT_DEADLINE_HOURS", default=24)),
    # A failed purchase becomes final (void) after this, and only when every authorization
    # it received is provably unusable.
    "FAILED_FINAL_AFTER": timedelta(
        hours=env.int("TOLLBOOTH_FAILED_FINAL_AFTER_HOURS", default=24)
    ),
    # The authorization flow (docs/x402.md, "Payment flows"): a held authorization whose
    # work has not ended this long before its validBefore is settled anyway (its outcome
    # kept unknown; a refund is owed if it later proves failed), so it can still land.
    "AUTHORIZATION_SETTLE_MARGIN": timedelta(
        seconds=env.int("TOLLBOOTH_AUTHORIZATION_SETTLE_MARGIN_SECONDS", default=120)
    ),
    # The longest window an authorization-flow 402 asks for (its maxTimeoutSeconds: the
    # work's deadline + the settle margin + the network's confirmation timeout, capped
    # here): a long window is a long time for the buyer's funds to move away.
    "AUTHORIZATION_MAX_WINDOW": timedelta(
        seconds=env.int("TOLLBOOTH_AUTHORIZATION_MAX_WINDOW_SECONDS", default=3600)
    ),
    # The paying request owns a fresh broadcast this long before the reconciler looks too.
    "SETTLEMENT_GRACE": timedelta(
        seconds=env.int("TOLLBOOTH_SETTLEMENT_GRACE_SECONDS", default=120)
    ),
    # A signed authorization that never reached the chain (nonce unused, no broadcast of it
    # pending) is submitted again at most this many times per attempt, with backoff; then
    # it waits for its window to close and support is told. EIP-3009 makes a second
    # settlement of one authorization impossible, so a resubmission can never charge twice.
    "SETTLEMENT_RESUBMIT_LIMIT": env.int("TOLLBOOTH_SETTLEMENT_RESUBMIT_LIMIT", default=5),
    # Refund paybacks (docs/finance.md): a chain refund closes only on a transfer from one
    # of the seller's wallets. Those are the offerings' recipients, the relayers, and these
    # (a treasury or a Safe finance pays from), comma-separated addresses; the books flag
    # a payment from any of them and keep it out of revenue.
    "SELLER_WALLETS": env.list("TOLLBOOTH_SELLER_WALLETS", default=[]),
    # The Safe multisig finance pays refunds from, named in the Safe Transaction Builder
    # batches the refund list exports. It counts as a seller wallet, and the payback watch
    # closes an exported refund by itself once the Safe's transfer of it is final.
    "REFUND_SAFE": env.str("TOLLBOOTH_REFUND_SAFE", default=""),
    # A payback named before it is final (or while the node did not answer) is looked at
    # again this long after; the watch also offers transfers it finds as matches.
    "PAYBACK_RECHECK": timedelta(seconds=env.int("TOLLBOOTH_PAYBACK_RECHECK_SECONDS", default=60)),
    # Payouts (docs/finance.md#payouts): refunds Tollbooth pays itself from the refund
    # wallet. Its key comes from the environment only (X402_<NET>_REFUND_WALLET_KEY per
    # network, else this one); TOLLBOOTH_REFUND_SIGNER names another signer class (a KMS).
    "REFUND_WALLET_KEY": env.str("TOLLBOOTH_REFUND_WALLET_KEY", default=""),
    "REFUND_SIGNER": env.str("TOLLBOOTH_REFUND_SIGNER", default="payments.signers.EnvKeySigner"),
    # Who signs the relayer's settlements (direct mode): the default reads
    # X402_<NET>_RELAYER_KEY; another class (a KMS, a hardware signer) plugs in here
    # (payments/signers.py, docs/deployment.md "Signers").
    "RELAYER_SIGNER": env.str(
        "TOLLBOOTH_RELAYER_SIGNER", default="payments.signers.EnvRelayerKeySigner"
    ),
    # The most the refund wallet pays out per UTC day, per asset, in atomic units:
    # `<token address>=<units>` pairs, `*` for every other asset. An asset with no cap pays
    # nothing out (a forgotten setting must not mean "no limit").
    "PAYOUT_DAILY_CAPS": {
        str(asset).lower(): int(units)
        for asset, units in env.dict("TOLLBOOTH_PAYOUT_DAILY_CAPS", default={}).items()
    },
    # A payout recorded this long without its broadcast (the worker died, the broker was
    # down) is sent by the reconcile job; a pending one is looked at again this often.
    "PAYOUT_BROADCAST_GRACE": timedelta(
        seconds=env.float("TOLLBOOTH_PAYOUT_BROADCAST_GRACE_SECONDS", default=60.0)
    ),
    "PAYOUT_RECHECK": timedelta(
        seconds=env.float("TOLLBOOTH_PAYOUT_RECHECK_SECONDS", default=30.0)
    ),
    # The external job service used by the http_job executor.
    "JOB_SERVICE_URL": env.str("JOB_SERVICE_URL", default="http://127.0.0.1:8765"),
    "JOB_SERVICE_TIMEOUT": env.float("JOB_SERVICE_TIMEOUT_SECONDS", default=5.0),
}

# --- x402 on EVM ------------------------------------------------------------------
# One entry per network, by CAIP-2 id. `mode` is "direct" (our relayer key broadcasts)
# or "facilitator" (X402_<NET>_FACILITATOR_URL, else X402_FACILITATOR_URL, settles, with the
# credentials of the same level). Keys only ever come from the environment.
# `confirmations` is the depth at which a payment counts as settled (the work may run);
# `finality` says when no reorg can undo it any more, and until then it stays watched:
# "depth" (its block `finality_depth` deep; anvil has no meaningful finalized tag) or
# "finalized" (at or below the node's `finalized` block, as Base's L1-backed nodes report).
X402_FACILITATOR_URL = env.str("X402_FACILITATOR_URL", default="")


def _facilitator_auth_env(prefix: str) -> dict[str, str]:
    """One facilitator's credentials (payments/rails/x402/facilitator_auth.py), at most one
    kind: a CDP Secret API key (id and secret), a bearer token, or a named API-key header and
    its value; "" when unset. Global (prefix ""): `CDP_API_KEY_ID` / `CDP_API_KEY_SECRET`,
    the names CDP's SDKs read, and `X402_FACILITATOR_...`; per network (prefix
    "X402_<NET>_"): `X402_<NET>_CDP_API_KEY_ID`, `X402_<NET>_FACILITATOR_BEARER_TOKEN`, ..."""
    facilitator = prefix or "X402_"
    return {
        "cdp_api_key_id": env.str(f"{prefix}CDP_API_KEY_ID", default=""),
        "cdp_api_key_secret": env.str(f"{prefix}CDP_API_KEY_SECRET", default=""),
        "bearer_token": env.str(f"{facilitator}FACILITATOR_BEARER_TOKEN", default=""),
        "api_key_header": env.str(f"{facilitator}FACILITATOR_API_KEY_HEADER", default=""),
        "api_key": env.str(f"{facilitator}FACILITATOR_API_KEY", default=""),
    }


def _default_mode(net: str) -> str:
    """`facilitator` when a facilitator settles this network (its own URL or the global one)."""
    own = env.str(f"X402_{net}_FACILITATOR_URL", default="")
    return "facilitator" if own or X402_FACILITATOR_URL else "direct"


# The global facilitator's credentials; a network with its own X402_<NET>_FACILITATOR_URL
# uses only its own X402_<NET>_... credentials (a token never goes to a facilitator it was
# not issued for).
X402_FACILITATOR_AUTH = _facilitator_auth_env("")
X402_NETWORKS = {
    "eip155:31337": {  # local anvil: the demo and the tests
        "chain_id": 31337,
        "rpc_url": env.str("X402_LOCAL_RPC_URL", default="http://127.0.0.1:8545"),
        "rpc_url_fallback": env.str("X402_LOCAL_RPC_URL_FALLBACK", default=""),
        "token_address": env.str("X402_LOCAL_TOKEN", default=""),
        "token_name": "USDC",
        "token_version": "2",
        "confirmations": env.int("X402_LOCAL_CONFIRMATIONS", default=1),
        "confirmation_timeout": env.float("X402_LOCAL_CONFIRMATION_TIMEOUT", default=5.0),
        "finality": env.str("X402_LOCAL_FINALITY", default="depth"),
        "finality_depth": env.int("X402_LOCAL_FINALITY_DEPTH", default=3),
        "mode": env.str("X402_LOCAL_MODE", default=_default_mode("LOCAL")),
        "facilitator_url": env.str("X402_LOCAL_FACILITATOR_URL", default=""),
        "facilitator_auth": _facilitator_auth_env("X402_LOCAL_"),
        "relayer_private_key": env.str("X402_LOCAL_RELAYER_KEY", default=""),
        "relayer_min_gas": env.int("X402_LOCAL_RELAYER_MIN_GAS", default=None),
        "refund_wallet_key": env.str("X402_LOCAL_REFUND_WALLET_KEY", default=""),
        "explorer_tx_url": "",  # a local chain has no explorer
    },
    "eip155:84532": {  # Base Sepolia
        "chain_id": 84532,
        "rpc_url": env.str("X402_BASE_SEPOLIA_RPC_URL", default="https://sepolia.base.org"),
        "rpc_url_fallback": env.str("X402_BASE_SEPOLIA_RPC_URL_FALLBACK", default=""),
        "token_address": env.str(
            "X402_BASE_SEPOLIA_TOKEN", default="0x036CbD53842c5426634e7929541eC2318f3dCF7e"
        ),
        "token_name": "USDC",
        "token_version": "2",
        "confirmations": env.int("X402_BASE_SEPOLIA_CONFIRMATIONS", default=2),
        "confirmation_timeout": env.float("X402_BASE_SEPOLIA_CONFIRMATION_TIMEOUT", default=30.0),
        "finality": env.str("X402_BASE_SEPOLIA_FINALITY", default="finalized"),
        "finality_depth": env.int("X402_BASE_SEPOLIA_FINALITY_DEPTH", default=64),
        "mode": env.str("X402_BASE_SEPOLIA_MODE", default=_default_mode("BASE_SEPOLIA")),
        "facilitator_url": env.str("X402_BASE_SEPOLIA_FACILITATOR_URL", default=""),
        "facilitator_auth": _facilitator_auth_env("X402_BASE_SEPOLIA_"),
        "relayer_private_key": env.str("X402_BASE_SEPOLIA_RELAYER_KEY", default=""),
        "relayer_min_gas": env.int("X402_BASE_SEPOLIA_RELAYER_MIN_GAS", default=None),
        "refund_wallet_key": env.str("X402_BASE_SEPOLIA_REFUND_WALLET_KEY", default=""),
        "explorer_tx_url": "https://sepolia.basescan.org/tx/{tx_hash}",
    },
    "eip155:8453": {  # Base mainnet
        "chain_id": 8453,
        "rpc_url": env.str("X402_BASE_RPC_URL", default="https://mainnet.base.org"),
        "rpc_url_fallback": env.str("X402_BASE_RPC_URL_FALLBACK", default=""),
        "token_address": env.str(
            "X402_BASE_TOKEN", default="0x833589fCD6eDb6E08f4c7C32D4f71b54bdA02913"
        ),
        "token_name": "USD Coin",
        "token_version": "2",
        "confirmations": env.int("X402_BASE_CONFIRMATIONS", default=3),
        "confirmation_timeout": env.float("X402_BASE_CONFIRMATION_TIMEOUT", default=60.0),
        "finality": env.str("X402_BASE_FINALITY", default="finalized"),
        "finality_depth": env.int("X402_BASE_FINALITY_DEPTH", default=64),
        "mode": env.str("X402_BASE_MODE", default=_default_mode("BASE")),
        "facilitator_url": env.str("X402_BASE_FACILITATOR_URL", default=""),
        "facilitator_auth": _facilitator_auth_env("X402_BASE_"),
        "relayer_private_key": env.str("X402_BASE_RELAYER_KEY", default=""),
        "relayer_min_gas": env.int("X402_BASE_RELAYER_MIN_GAS", default=None),
        "refund_wallet_key": env.str("X402_BASE_REFUND_WALLET_KEY", default=""),
        "explorer_tx_url": "https://basescan.org/tx/{tx_hash}",
    },
}
# How long a relayer nonce's holder has to record and send its transaction: once the node's
# pending count has stood at a gap this long, the next broadcast or heal-relayers closes it.
X402_RELAYER_NONCE_LEASE_SECONDS = env.float("X402_RELAYER_NONCE_LEASE_SECONDS", default=10.0)
# How often beat reads each direct-mode relayer's gas balance (payments/rails/x402/gas.py).
# A reading older than ten of these is unknown again (the beat stopped): it refuses nothing.
X402_RELAYER_GAS_EVERY_SECONDS = env.float("X402_RELAYER_GAS_EVERY_SECONDS", default=30.0)
X402_FACILITATOR_TIMEOUT = env.float("X402_FACILITATOR_TIMEOUT_SECONDS", default=10.0)
# Anonymous 402s offer a quote that lives this long and holds no stock.
X402_ANONYMOUS_QUOTE_TTL_SECONDS = env.int("X402_ANONYMOUS_QUOTE_TTL_SECONDS", default=120)
# An anonymous 402 writes nothing: its quote's terms travel signed in the 402
# (`accepts[].extra.signedQuote`, purchases/services/x402/quote_seal.py, docs/x402.md) and the
# quote is written with the purchase. HMAC-SHA256 key: this one, or (empty) a key derived from
# SECRET_KEY. Rotation: put the old key in the fallbacks (comma-separated) for at least
# X402_ANONYMOUS_QUOTE_TTL_SECONDS; empty fallbacks: SECRET_KEY_FALLBACKS.
X402_QUOTE_SIGNING_KEY = env.str("X402_QUOTE_SIGNING_KEY", default="")
X402_QUOTE_SIGNING_KEY_FALLBACKS = env.list("X402_QUOTE_SIGNING_KEY_FALLBACKS", default=[])
# After settlement the request waits this long for a fast job, then answers 202.
X402_RESULT_WAIT_SECONDS = env.float("X402_RESULT_WAIT_SECONDS", default=10.0)
# A 402's sign-in-with-x challenge is good this long (the extension's default: 5 minutes);
# 0 declares none, so no one can fetch a result again without paying.
X402_SIGN_IN_TTL_SECONDS = env.int("X402_SIGN_IN_TTL_SECONDS", default=300)
# Production turns this on (config/settings/production.py): a database system check then
# refuses an active offering on a local chain (purchases/checks.py). The demo sells there.
X402_REFUSE_LOCAL_NETWORKS = False

# --- Signed receipts (fulfillment/receipt_signing.py, docs/receipts.md) ---------------
# The seller's receipt key (hex private key) signs every paid answer's receipt; its address
# is published at /.well-known/tollbooth-receipts under KEY_ID (default: from the address).
# A rotated key stays listed in RETIRED_KEYS (`key_id=0xaddress`): receipts never expire.
# Without a key, the demo and the tests generate one into KEY_FILE; production refuses.
RECEIPTS = {
    "KEY": env.str("TOLLBOOTH_RECEIPT_KEY", default=""),
    "KEY_ID": env.str("TOLLBOOTH_RECEIPT_KEY_ID", default=""),
    "RETIRED_KEYS": env.list("TOLLBOOTH_RECEIPT_RETIRED_KEYS", default=[]),
    "KEY_FILE": None,
}
# Where the seller's paid URLs are reached: a receipt's `resourceUrl` is this + /x402/<slug>.
TOLLBOOTH_PUBLIC_URL = env.str("TOLLBOOTH_PUBLIC_URL", default="http://localhost:8000").rstrip("/")

# --- Alerts (purchases/notify.py) ----------------------------------------------------
# Money owed and stuck states reach people through these backends ("log", "mail",
# "webhook" or dotted paths); the webhook is added automatically when its URL is set.
ADMINS = [tuple(pair.split(":", 1)) for pair in env.list("DJANGO_ADMINS", default=[])]
SERVER_EMAIL = env.str("DJANGO_SERVER_EMAIL", default="tollbooth@localhost")
EMAIL_BACKEND = env.str(
    "DJANGO_EMAIL_BACKEND", default="django.core.mail.backends.console.EmailBackend"
)
TOLLBOOTH_ALERT_BACKENDS = env.list("TOLLBOOTH_ALERT_BACKENDS", default=[]) or None
TOLLBOOTH_ALERT_WEBHOOK_URL = env.str("TOLLBOOTH_ALERT_WEBHOOK_URL", default="")
TOLLBOOTH_ALERT_WEBHOOK_TIMEOUT_SECONDS = env.float(
    "TOLLBOOTH_ALERT_WEBHOOK_TIMEOUT_SECONDS", default=5.0
)
# /metrics answers without auth unless this token is set (then: Authorization: Bearer <token>).
TOLLBOOTH_METRICS_TOKEN = env.str("TOLLBOOTH_METRICS_TOKEN", default="")
# prometheus_client's multiprocess mode (backoffice/metrics.py): the directory every process
# of a host writes its counters to, emptied before they start. Unset: per-process counters.
TOLLBOOTH_METRICS_PROCESS_DIR = env.str("PROMETHEUS_MULTIPROC_DIR", default="")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "filters": {
        "redact_capabilities": {"()": "config.log_filters.RedactCapabilityTokens"},
        "quiet_payment_required": {"()": "config.log_filters.QuietPaymentRequired"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
    "loggers": {
        # Django logs every 4xx with its path; a status URL's path holds its secret.
        "django.request": {"filters": ["redact_capabilities", "quiet_payment_required"]},
        # runserver's request lines (its own handler is replaced by ours here).
        "django.server": {
            "handlers": ["console"],
            "filters": ["redact_capabilities"],
            "propagate": False,
        },
        # django-axes announces itself at INFO on every start (each manage.py call); its
        # lockout warnings stay.
        "axes.apps": {"level": "WARNING"},
    },
}

# The beat schedule lives in code; each entry says why it exists.
# Jobs a service may stage in the outbox (purchases.services.shared.outbox.outbox_stage), by name,
# and the Celery task the relay sends each to. Named here, as the beat schedule names its
# tasks, so no service imports purchases.tasks.
OUTBOX_JOBS = {
    "purchase_execute": "purchases.tasks.purchase_execute_task",
    "purchase_execution_recheck": "purchases.tasks.purchase_execution_recheck_task",
    "payment_settle_captured": "purchases.tasks.payment_settle_captured_task",
    "refund_alert": "purchases.tasks.refund_alert_task",
    "payout_broadcast": "purchases.tasks.payout_broadcast_task",
    "escalation_alert": "purchases.tasks.escalation_alert_task",
    "facilitator_refused_alert": "purchases.tasks.facilitator_refused_alert_task",
    "webhook_event_publish": "webhooks.tasks.webhook_event_publish_task",
    "webhook_delivery_attempt": "webhooks.tasks.webhook_delivery_attempt_task",
}

# Signed webhooks (docs/webhooks.md). HTTPS only, unless DEBUG (a local receiver); the
# timeouts bound what a slow endpoint costs a worker, never a purchase.
WEBHOOKS = {
    "REQUIRE_HTTPS": env.bool("TOLLBOOTH_WEBHOOKS_REQUIRE_HTTPS", default=not DEBUG),
    "CONNECT_TIMEOUT_SECONDS": env.float("TOLLBOOTH_WEBHOOKS_CONNECT_TIMEOUT", default=3.0),
    "READ_TIMEOUT_SECONDS": env.float("TOLLBOOTH_WEBHOOKS_READ_TIMEOUT", default=10.0),
    # Networks a webhook may reach although not public (CIDRs, comma-separated): for tests and
    # a local receiver (loopback under DEBUG). Empty: private, loopback, link-local ...
    # addresses are refused.
    "ALLOWED_NETWORKS": env.list(
        "TOLLBOOTH_WEBHOOKS_ALLOWED_NETWORKS", default=["127.0.0.0/8", "::1/128"] if DEBUG else []
    ),
    # A buyer's callback secret is derived from this key and a salt in the row (never stored);
    # empty: SECRET_KEY. Set it so a rotation of SECRET_KEY does not change callback secrets.
    "CALLBACK_SECRET_KEY": env.str("TOLLBOOTH_WEBHOOKS_CALLBACK_SECRET_KEY", default=""),
    # Delivered deliveries (and their attempts) are pruned this long after delivery.
    "DELIVERED_RETENTION_DAYS": env.int("TOLLBOOTH_WEBHOOKS_DELIVERED_RETENTION_DAYS", default=30),
    # Endpoints tried at once by one sweep or publication: one thread each (docs/webhooks.md).
    "LANES": env.int("TOLLBOOTH_WEBHOOKS_LANES", default=8),
    # How long one lane keeps sending to its endpoint before giving the worker back.
    "LANE_BUDGET_SECONDS": env.float("TOLLBOOTH_WEBHOOKS_LANE_BUDGET_SECONDS", default=30.0),
}

CELERY_BEAT_SCHEDULE = {
    # Webhook deliveries whose next try is due (a retry after backoff, an endpoint enabled
    # again, a publish whose worker died). An idle run is one indexed query.
    "send-due-webhooks": {
        "task": "webhooks.tasks.webhook_deliveries_due_task",
        "schedule": env.float("TOLLBOOTH_WEBHOOKS_SWEEP_EVERY_SECONDS", default=10.0),
    },
    # Delivered webhook deliveries past their retention: their rows and attempts go.
    "prune-webhook-deliveries": {
        "task": "webhooks.tasks.webhook_deliveries_prune_task",
        "schedule": 3600.0,
    },
    # A webhook endpoint that has answered no 2xx for an hour: tell a person once.
    "alert-failing-webhooks": {
        "task": "webhooks.tasks.webhook_failing_alert_task",
        "schedule": 60.0,
    },
    # Jobs staged in the outbox whose immediate relay never ran (process died after the
    # commit) or failed (broker down): send them. Runs often; an idle run is one query.
    "relay-outbox": {
        "task": "purchases.tasks.outbox_relay_task",
        "schedule": env.float("TOLLBOOTH_OUTBOX_RELAY_EVERY_SECONDS", default=5.0),
    },
    # Relayed outbox messages past retention, so the table does not grow forever.
    "prune-outbox": {"task": "purchases.tasks.outbox_prune_task", "schedule": 3600.0},
    # A job relayed but lost with its broker (Redis restarted) or its worker: re-stage paid
    # purchases nobody is running, and resume executions whose worker stopped renewing.
    "sweep-stalled-executions": {
        "task": "purchases.tasks.purchase_sweep_stalled_task",
        "schedule": env.float("TOLLBOOTH_SWEEP_EVERY_SECONDS", default=30.0),
    },
    # Held authorizations (the authorization flow) whose work ended without its terminal
    # move capturing or releasing them (a worker killed), or whose settle margin nears.
    "sweep-held-authorizations": {
        "task": "purchases.tasks.authorizations_held_sweep_task",
        "schedule": env.float("TOLLBOOTH_HELD_SWEEP_EVERY_SECONDS", default=30.0),
    },
    # Executions that ended unknown (the job service was down through every try): ask the
    # job again once its next check is due, so the buyer's paid work completes when the
    # service is back. Rows carry their own schedule; an idle run is one indexed query.
    "recheck-unknown-executions": {
        "task": "purchases.tasks.recheck_unknown_executions_task",
        "schedule": env.float("TOLLBOOTH_RECHECK_EVERY_SECONDS", default=30.0),
    },
    # Broadcasts with unknown finality: look them up by tx hash and (payer, nonce), in batches;
    # rows carry their own backoff, so running often costs nothing for rows not yet due.
    "reconcile-pending-settlements": {
        "task": "purchases.tasks.reconcile_pending_settlements_task",
        "schedule": 30.0,
    },
    # A settled payment is not final until the network's finality policy says so: a reorg
    # before then can undo it, and its same authorization must be settled again (or the
    # purchase reversed and escalated). Rows carry their next check, so idle runs are cheap.
    # Once final, the books take the block's time and the receipt's gas (docs/finance.md).
    "watch-unfinal-settlements": {
        "task": "purchases.tasks.watch_unfinal_settlements_task",
        "schedule": 30.0,
    },
    # Money that lands after we recorded a failure must become a refund-owed within minutes.
    "watch-failed-attempts": {
        "task": "purchases.tasks.watch_failed_attempts_task",
        "schedule": 120.0,
    },
    # Failed purchases become final only once every authorization is provably unusable.
    "finalize-failed-purchases": {
        "task": "purchases.tasks.finalize_failed_purchases_task",
        "schedule": 900.0,
    },
    # Open quotes past expiry hold stock that other buyers are waiting for.
    "expire-quotes": {"task": "purchases.tasks.expire_quotes_task", "schedule": 60.0},
    # Unpaid quotes (an anonymous 402 opens one per request) would grow the table forever.
    "purge-expired-quotes": {
        "task": "purchases.tasks.purge_expired_quotes_task",
        "schedule": 3600.0,
    },
    # The running prepaid balances must equal the sum of their ledger entries.
    "check-ledger-balances": {
        "task": "purchases.tasks.check_ledger_balances_task",
        "schedule": 3600.0,
    },
    # Payment ids past retention keep only their hash, so the table does not grow forever.
    "compact-payment-ids": {"task": "purchases.tasks.compact_payment_ids_task", "schedule": 3600.0},
    # A dropped relayer transaction or a nonce lost in a crash stalls every later one. A run
    # with nothing to heal is 4 statements and 2 RPC calls: it runs as often as the nonce
    # lease (X402_RELAYER_NONCE_LEASE_SECONDS), so a gap no settlement closes waits at most
    # about two leases.
    "heal-relayers": {
        "task": "purchases.tasks.heal_relayers_task",
        "schedule": env.float("TOLLBOOTH_HEAL_RELAYERS_EVERY_SECONDS", default=10.0),
    },
    # A relayer without gas cannot settle: read each direct-mode relayer's balance, alert
    # below X402_<NET>_RELAYER_MIN_GAS, and let paid requests refuse (503) with too little
    # to settle one payment, from this reading, never an RPC call per request.
    "watch-relayer-gas": {
        "task": "purchases.tasks.relayer_funds_watch_task",
        "schedule": X402_RELAYER_GAS_EVERY_SECONDS,
    },
    # Chain paybacks named before they were final are closed once they are; transfers from
    # the seller's wallets that pay an owed refund back are offered to finance as matches.
    "watch-refund-paybacks": {
        "task": "purchases.tasks.refund_paybacks_watch_task",
        "schedule": 60.0,
    },
    # Payouts recorded but never broadcast (a worker died between the two), dropped from the
    # pool (sent again, the same bytes), or not final yet: each is looked at when due, and
    # its refund closes on the chain's proof once final. Idle runs are one indexed query.
    "reconcile-payouts": {"task": "purchases.tasks.payouts_reconcile_task", "schedule": 30.0},
    # Refund-owed alerts that a crashed process never sent.
    "send-pending-alerts": {"task": "purchases.tasks.send_pending_alerts_task", "schedule": 60.0},
}
# A periodic run no worker took before the next one was due is dropped (Celery's `expires`):
# after a worker outage the queue holds one run of each job, not one per missed tick.
for _entry in CELERY_BEAT_SCHEDULE.values():
    _entry.setdefault("options", {"expires": float(_entry["schedule"])})  # type: ignore[arg-type]
