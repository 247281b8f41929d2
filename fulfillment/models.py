"""Execution attempts, results and receipts. Hangs beneath purchases."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q
from django_fsm import ConcurrentTransition, ConcurrentTransitionMixin, transition

from core.fsm import FSMField
from core.refs import new_ref


class ExecutionAttempt(ConcurrentTransitionMixin, models.Model):
    """One try to run the paid work, owned by one worker through a lease."""

    class State(models.TextChoices):
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        UNKNOWN = "unknown", "Effect unknown, escalated"

    purchase = models.ForeignKey(
        "purchases.Purchase", on_delete=models.PROTECT, related_name="execution_attempts"
    )
    executor = models.CharField(max_length=64)
    worker = models.CharField(max_length=120, help_text="Who holds the lease now.")
    lease_token = models.CharField(max_length=32)
    lease_expires_at = models.DateTimeField()
    takeovers = models.PositiveIntegerField(
        default=0, help_text="Leases taken over after a worker died."
    )
    tries = models.PositiveIntegerField(
        default=0,
        help_text="Tries started on this execution. Counted here, not in the task, so a "
        "retry, a sweeper's new task or a restarted worker continues the count.",
    )
    job_ref = models.CharField(
        max_length=200, blank=True, help_text="Saved the moment the job exists."
    )
    job_idempotency_key = models.CharField(max_length=120)
    reason_code = models.CharField(max_length=64, blank=True)
    # An execution that ended unknown is not forgotten: its job is asked again on a slower
    # schedule (purchases.services.fulfil.execution_recheck) until the executor says for sure.
    next_check_at = models.DateTimeField(
        null=True, blank=True, help_text="When an unknown execution's job is asked again."
    )
    checks = models.PositiveIntegerField(
        default=0, help_text="Checks of the job made since the execution ended unknown."
    )
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    state = FSMField(default=State.RUNNING, choices=State.choices, protected=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["purchase"],
                condition=Q(state="running"),
                name="one_live_execution_per_purchase",
            ),
        ]
        indexes = [
            # The recheck sweep's read: unknown executions whose next check is due.
            models.Index(
                fields=["next_check_at"],
                condition=Q(state="unknown"),
                name="unknown_execution_next_check",
            ),
        ]

    @classmethod
    def held(cls, *, attempt_id: int, lease_token: str, job_ref: str) -> ExecutionAttempt:
        """The running attempt as its lease holder knows it, without reading it back: a
        transition saved on it writes only while the attempt is still running under this
        lease (one conditional UPDATE), else raises ConcurrentTransition."""
        attempt = cls(
            pk=attempt_id, lease_token=lease_token, job_ref=job_ref, state=cls.State.RUNNING
        )
        attempt._state.adding = False
        attempt._held_lease = lease_token
        return attempt

    # The lease a `held` attempt was made under; None for one read from the database.
    _held_lease: str | None = None

    def save(self, *args: Any, **kwargs: Any) -> None:
        """A `held` attempt writes the fields named only while the row is still running under
        its lease: one conditional UPDATE (the public update(), not a private save hook), and
        ConcurrentTransition when the row no longer holds them. Any other save is Django's."""
        if self._held_lease is None:
            super().save(*args, **kwargs)
            return
        fields = [self._meta.get_field(name) for name in kwargs["update_fields"]]
        written = (
            type(self)
            ._default_manager.filter(
                pk=self.pk, state=self.State.RUNNING, lease_token=self._held_lease
            )
            .update(**{field.attname: field.pre_save(self, False) for field in fields})  # type: ignore[union-attr]
        )
        if not written:
            raise ConcurrentTransition(
                f"execution attempt {self.pk} is no longer running under this lease"
            )

    @transition(field=state, source=State.RUNNING, target=State.SUCCEEDED)
    def succeed(self, *, at: Any) -> None:
        self.finished_at = at

    @transition(field=state, source=State.RUNNING, target=State.FAILED)
    def fail(self, *, reason_code: str, at: Any) -> None:
        self.reason_code = reason_code
        self.finished_at = at

    @transition(field=state, source=State.RUNNING, target=State.UNKNOWN)
    def lose_track(self, *, reason_code: str, at: Any) -> None:
        self.reason_code = reason_code
        self.finished_at = at

    @transition(field=state, source=State.UNKNOWN, target=State.SUCCEEDED)
    def succeed_on_recheck(self, *, job_ref: str, at: Any) -> None:
        """A later check found the job finished: the work ran once, its result is ours."""
        self.job_ref = job_ref
        self.finished_at = at
        self.next_check_at = None

    @transition(field=state, source=State.UNKNOWN, target=State.FAILED)
    def fail_on_recheck(self, *, reason_code: str, at: Any) -> None:
        """A later check got the executor's definitive word that the work failed."""
        self.reason_code = reason_code
        self.finished_at = at
        self.next_check_at = None

    def __str__(self) -> str:
        return f"execution {self.pk} ({self.state})"


class Result(models.Model):
    purchase = models.OneToOneField(
        "purchases.Purchase", on_delete=models.PROTECT, related_name="result"
    )
    execution = models.OneToOneField(
        ExecutionAttempt, on_delete=models.PROTECT, related_name="result"
    )
    content_type = models.CharField(max_length=100)
    body = models.BinaryField(help_text="Emptied when retention ends; the hash stays.")
    sha256 = models.CharField(max_length=64)
    size = models.PositiveIntegerField()
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    first_delivered_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"result of {self.purchase_id}"


class Receipt(models.Model):
    """Public proof of a purchase. Never shows a client-supplied id."""

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    purchase = models.OneToOneField(
        "purchases.Purchase", on_delete=models.PROTECT, related_name="receipt"
    )
    payer = models.CharField(max_length=64)
    amount = models.PositiveBigIntegerField()
    asset = models.CharField(max_length=64)
    network = models.CharField(max_length=64)
    transaction = models.CharField(max_length=120)
    body_sha256 = models.CharField(max_length=64)
    delivered_at = models.DateTimeField()
    last_fetch_noted_at = models.DateTimeField(
        null=True,
        blank=True,
        editable=False,
        help_text="When a public fetch last went on the purchase's timeline: fetches are "
        "noted at most once a window, so a GET cannot grow the timeline without bound.",
    )
    # The signed receipt (fulfillment.receipt_signing), exactly as first sent: issued once
    # the payment is final, then sent again byte for byte, for ever (it never expires).
    signed = models.TextField(
        blank=True, editable=False, help_text="The signed receipt's JSON text; empty until final."
    )
    key_id = models.CharField(max_length=64, blank=True, editable=False)
    issued_at = models.DateTimeField(null=True, blank=True, editable=False)

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.public_id:
            self.public_id = new_ref("rcp")
        super().save(*args, **kwargs)

    def __str__(self) -> str:
        return self.public_id


class Upstream(models.Model):
    """Where an offering's paid work runs, when it is not a built-in executor: the seller's
    HTTP endpoint, job service, installed Python executor or MCP tool. The signing secret is
    named by an environment variable and never stored here."""

    class Kind(models.TextChoices):
        HTTP = "http", "HTTP endpoint (synchronous)"
        HTTP_JOB = "http_job", "Job service (asynchronous job contract)"
        PYTHON = "python", "Installed Python executor (entry point)"
        MCP = "mcp", "MCP tool (Streamable HTTP)"

    class InputMode(models.TextChoices):
        JSON = "json", "JSON body"
        QUERY = "query", "Query parameters"
        # An existing API sold as it is: /x402/<offering>/<rest> is sent to the URL's <rest>
        # with the paid request's method, query string and body (docs/upstreams.md).
        REQUEST = "request", "The paid request itself (passes the path through)"

    offering = models.OneToOneField(
        "purchases.Offering", on_delete=models.CASCADE, related_name="upstream"
    )
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.HTTP)
    url = models.URLField(
        max_length=500, blank=True, help_text="Endpoint (http, mcp) or base URL (http_job)."
    )
    method = models.CharField(max_length=8, default="POST")
    timeout_seconds = models.DecimalField(max_digits=5, decimal_places=2, default=10)
    input_mode = models.CharField(max_length=8, choices=InputMode.choices, default=InputMode.JSON)
    secret_env = models.CharField(
        max_length=100,
        blank=True,
        help_text="NAME of the environment variable holding the signing secret (e.g. "
        "TOLLBOOTH_UPSTREAM_SECRET_SEARCH). The secret itself is never stored.",
    )
    # A rotation without a gap (docs/upstreams.md): every call is signed with the current
    # secret and, until it is retired, the previous one too, each named by its key id.
    key_id = models.CharField(
        max_length=32,
        blank=True,
        help_text="The current secret's key id, sent with its signature (kid=...). Empty: the "
        "single-secret header of before (v1=... alone).",
    )
    previous_secret_env = models.CharField(
        max_length=100,
        blank=True,
        help_text="During a rotation: NAME of the variable holding the secret being replaced. "
        "Calls are signed with both until it is emptied.",
    )
    previous_key_id = models.CharField(
        max_length=32,
        blank=True,
        help_text="The previous secret's key id (empty if it had none).",
    )
    definitive_statuses = models.JSONField(
        default=list,
        blank=True,
        help_text="4xx codes that prove the work did not happen (failure, refund per policy). "
        "Any other 4xx is unknown.",
    )
    max_result_bytes = models.PositiveIntegerField(default=1024 * 1024)
    idempotent = models.BooleanField(
        default=False, help_text="mcp only: the tool may be called again with the same key."
    )
    entry_point = models.CharField(
        max_length=64, blank=True, help_text="python only: the entry point's name."
    )
    tool = models.CharField(max_length=128, blank=True, help_text="mcp only: the tool's name.")
    dry_run = models.JSONField(
        default=dict,
        blank=True,
        help_text='Optional call the check may make, e.g. {"method": "GET", "path": "/health"}. '
        "Without it the check never calls the operation.",
    )
    # Empty: the deployment's TOLLBOOTH_EXECUTION_MAX_TRIES / _DEADLINE_MINUTES.
    max_tries = models.PositiveSmallIntegerField(
        null=True,
        blank=True,
        help_text="Tries per purchase while the outcome is unknown, then escalated. Empty: the "
        "deployment's default.",
    )
    deadline_seconds = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Seconds from a purchase's first try after which no further try starts "
        "(escalated). Empty: the deployment's default.",
    )

    def __str__(self) -> str:
        return f"{self.kind} {self.url or self.entry_point}"

    def clean(self) -> None:
        upstream_validate(self)


# Upper case, digits and underscores, not starting with a digit: what a shell exports.
ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,99}")
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
MIN_TIMEOUT, MAX_TIMEOUT = Decimal("0.1"), Decimal("300")
MAX_RESULT_BYTES = 64 * 1024 * 1024
MAX_TRIES = 100
MAX_DEADLINE_SECONDS = 7 * 24 * 3600  # a week: past it a person decides anyway
NEEDS_URL = frozenset({"http", "http_job", "mcp"})


def upstream_validate(upstream: Upstream) -> None:
    """Raise ValidationError naming every field that is wrong."""
    errors: dict[str, str] = {}
    secret_field = "secret_env"  # noqa: S105  (a field name: the secret is never on the row)
    if upstream.kind in NEEDS_URL:
        parts = urlsplit(upstream.url or "")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            errors["url"] = "An http:// or https:// URL with a host is required for this kind."
    if upstream.kind == "python" and not re.fullmatch(
        r"[A-Za-z0-9_.-]{1,64}", upstream.entry_point
    ):
        errors["entry_point"] = "Name the executor's entry point (group tollbooth.executors)."
    if upstream.kind == "mcp" and not re.fullmatch(r"[A-Za-z0-9_./-]{1,128}", upstream.tool):
        errors["tool"] = "Name the MCP tool that does the work."
    if str(upstream.method).upper() not in METHODS:
        errors["method"] = f"One of {', '.join(sorted(METHODS))}."
    if upstream.secret_env and not ENV_NAME.fullmatch(upstream.secret_env):
        errors[secret_field] = "An environment variable NAME (A-Z, 0-9, _), not the secret."
    if upstream.input_mode == "request" and upstream.kind != "http":
        errors["input_mode"] = "Only an http upstream passes the paid request through."
    if upstream.kind == "http" and not upstream.secret_env:
        errors[secret_field] = "An http upstream signs every call: name its secret's variable."
    errors.update(_rotation_errors(upstream))
    if not MIN_TIMEOUT <= Decimal(str(upstream.timeout_seconds)) <= MAX_TIMEOUT:
        errors["timeout_seconds"] = f"Between {MIN_TIMEOUT} and {MAX_TIMEOUT} seconds."
    if not 1 <= int(upstream.max_result_bytes) <= MAX_RESULT_BYTES:
        errors["max_result_bytes"] = f"Between 1 and {MAX_RESULT_BYTES} bytes."
    codes = upstream.definitive_statuses
    if not isinstance(codes, list) or not all(
        isinstance(c, int) and not isinstance(c, bool) and 400 <= c <= 499 for c in codes
    ):
        errors["definitive_statuses"] = "A list of 4xx codes, e.g. [400, 422]."
    elif 429 in codes:
        errors["definitive_statuses"] = "429 means 'not now': it can never be definitive."
    if upstream.max_tries is not None and not 1 <= int(upstream.max_tries) <= MAX_TRIES:
        errors["max_tries"] = f"Between 1 and {MAX_TRIES}, or empty for the default."
    deadline = upstream.deadline_seconds
    if deadline is not None and not 1 <= int(deadline) <= MAX_DEADLINE_SECONDS:
        errors["deadline_seconds"] = f"Between 1 and {MAX_DEADLINE_SECONDS}, or empty."
    dry_run_error = _dry_run_error(upstream.dry_run)
    if dry_run_error:
        errors["dry_run"] = dry_run_error
    if errors:
        raise ValidationError(errors)


KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,32}")  # no "=", ";" or ",": the header's separators


def _rotation_errors(upstream: Upstream) -> dict[str, str]:
    errors: dict[str, str] = {}
    for name in ("key_id", "previous_key_id"):
        value = getattr(upstream, name)
        if value and not KEY_ID.fullmatch(value):
            errors[name] = "Up to 32 letters, digits, '.', '_' or '-'."
    previous = upstream.previous_secret_env
    if not previous:
        if upstream.previous_key_id:
            errors["previous_key_id"] = "Only with a previous secret's variable."
        return errors
    previous_field = "previous_secret_env"
    if not ENV_NAME.fullmatch(previous):
        errors[previous_field] = "An environment variable NAME, not the secret."
    elif previous == upstream.secret_env:
        errors[previous_field] = "A rotation names a new variable for the new secret."
    # Two signatures in one header: the upstream tells them apart by key id.
    if not upstream.key_id:
        errors["key_id"] = "During a rotation the current secret needs a key id."
    elif upstream.key_id == upstream.previous_key_id:
        errors["key_id"] = "The new secret's key id must differ from the previous one's."
    return errors


def _dry_run_error(dry_run: Any) -> str:
    if dry_run in (None, {}):
        return ""
    if not isinstance(dry_run, dict) or set(dry_run) - {"method", "path", "body"}:
        return 'An object with "method", "path" and optionally "body".'
    if str(dry_run.get("method", "GET")).upper() not in METHODS:
        return f"method: one of {', '.join(sorted(METHODS))}."
    if not str(dry_run.get("path", "")).startswith("/"):
        return 'path: an absolute path on the upstream, e.g. "/health".'
    return ""
