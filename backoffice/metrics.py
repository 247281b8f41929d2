"""Prometheus metrics read from the database at scrape time, and the view that serves them.

Gauges come from the database, not from in-process counters, so every web process and
worker answers a scrape with the same numbers. Each scrape runs eight queries,
whatever the number of rows. A database that cannot answer fails the scrape (500), which
Prometheus reports as `up == 0`: better than a scrape of silent zeros.

Amounts are atomic units. They are summed as integers in the database and stay `int`
until the exposition, which can only carry float64: above 2**53 atomic units (9e9 USDC per
asset) the exported value is rounded, the database figure stays exact.

Setting: TOLLBOOTH_METRICS_TOKEN (default ""): when set, a scrape must send
`Authorization: Bearer <token>`.

The few in-process counters (payment-id conflicts, wallet sign-ins, facilitator refusals)
are counted in whichever process saw the event: a web thread, the ASGI door, a worker. With
PROMETHEUS_MULTIPROC_DIR set for every process of a host (prometheus_client's multiprocess
mode: each process writes its counts to a file there), a scrape of any one of them sums
them all; without it a scrape shows only the counts of the process that answered it.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime

from django.conf import settings
from django.db.models import Count, Max, Min, Q, Sum
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_safe
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    PLATFORM_COLLECTOR,
    REGISTRY,
    CollectorRegistry,
    Metric,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from payments.models import PaymentAttempt, Refund, RelayerGas

# The conflicts, sign-in and facilitator-refusal counters register themselves in the default
# registry when imported.
from payments.rails.x402 import facilitator  # noqa: F401
from purchases.models import OUTBOX_WAITING, Escalation, JobRun, OutboxMessage, Purchase
from purchases.services.checkout import idempotency  # noqa: F401
from purchases.services.x402 import sign_in  # noqa: F401
from webhooks.models import WebhookDelivery
from webhooks.services import FAILING_ALERT_AFTER

ATTEMPT = PaymentAttempt.State
SPECS: dict[str, tuple[str, list[str]]] = {
    "tollbooth_pending_settlements": (
        "Payment attempts broadcast (or being broadcast) whose finality is not known yet.",
        [],
    ),
    "tollbooth_oldest_pending_settlement_age_seconds": (
        "Age, from creation, of the oldest pending settlement; 0 when there is none.",
        [],
    ),
    "tollbooth_unknown_executions": ("Purchases whose fulfilment state is unknown.", []),
    "tollbooth_purchases_by_payment_state": ("Purchases per payment state.", ["state"]),
    "tollbooth_refunds_owed": ("Refunds owed and not yet paid back.", ["asset"]),
    "tollbooth_refunds_owed_amount": (
        "Sum owed back, in atomic units of the asset (exact below 2**53).",
        ["asset"],
    ),
    "tollbooth_escalations_open": ("Open escalations per owner.", ["owner"]),
    "tollbooth_escalations_overdue": ("Open escalations past their deadline.", ["owner"]),
    "tollbooth_outbox_backlog": (
        "Jobs staged in the outbox and not yet handed to the broker.",
        [],
    ),
    "tollbooth_outbox_oldest_unrelayed_age_seconds": (
        "Age, from staging, of the oldest job not yet handed to the broker; 0 when none.",
        [],
    ),
    "tollbooth_webhook_deliveries": (
        "Webhook deliveries per state (pending: not yet answered 2xx, retried).",
        ["state"],
    ),
    "tollbooth_webhook_oldest_pending_age_seconds": (
        "Age, from creation, of the oldest webhook delivery still pending; 0 when none.",
        [],
    ),
    "tollbooth_webhook_endpoints_failing": (
        "Enabled webhook endpoints with pending deliveries and no 2xx for an hour or more.",
        [],
    ),
    "tollbooth_job_lag_seconds": (
        "Seconds since the job last finished without error (since its first start if never).",
        ["job"],
    ),
    "tollbooth_job_last_run_timestamp_seconds": (
        "Unix time the job last started, whatever the outcome.",
        ["job"],
    ),
    "tollbooth_relayer_gas_balance_wei": (
        "Our relayer's gas balance as beat last read it, in wei (exact below 2**53).",
        ["network", "address"],
    ),
    "tollbooth_relayer_gas_minimum_wei": (
        "The relayer's low-gas alert threshold (X402_<NET>_RELAYER_MIN_GAS or its default).",
        ["network", "address"],
    ),
    "tollbooth_relayer_gas_read_timestamp_seconds": (
        "Unix time of the relayer's last gas reading (a stale one refuses no payment).",
        ["network", "address"],
    ),
}


def _families() -> dict[str, GaugeMetricFamily]:
    return {
        name: GaugeMetricFamily(name, doc, labels=labels) for name, (doc, labels) in SPECS.items()
    }


def _age_seconds(now: datetime, then: datetime) -> float:
    # Clocks of app servers differ a little; an age is never negative.
    return max(0.0, (now - then).total_seconds())


class TollboothCollector(Collector):
    """Reads the database on every scrape. `clock` is injectable for tests."""

    def __init__(self, *, clock: Callable[[], datetime] = timezone.now) -> None:
        self.clock = clock

    def describe(self) -> Iterable[GaugeMetricFamily]:
        # Without describe() registering would call collect(), querying at import time.
        return list(_families().values())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = self.clock()
        families = _families()
        self._settlements(families, now)
        self._purchases(families)
        self._refunds(families)
        self._escalations(families, now)
        self._jobs(families, now)
        self._outbox(families, now)
        self._webhooks(families, now)
        self._relayer_gas(families)
        yield from families.values()

    def _settlements(self, families: dict[str, GaugeMetricFamily], now: datetime) -> None:
        # "recorded" with a broadcast start is a send in progress (or one that died mid-way).
        pending = PaymentAttempt.objects.filter(
            Q(state=ATTEMPT.RECORDED, broadcast_started_at__isnull=False)
            | Q(state=ATTEMPT.SETTLEMENT_PENDING)
        ).aggregate(count=Count("pk"), oldest=Min("created_at"))
        oldest = pending["oldest"]
        families["tollbooth_pending_settlements"].add_metric([], pending["count"])
        families["tollbooth_oldest_pending_settlement_age_seconds"].add_metric(
            [], _age_seconds(now, oldest) if oldest is not None else 0.0
        )

    def _purchases(self, families: dict[str, GaugeMetricFamily]) -> None:
        unknown = Q(fulfillment_state=Purchase.FulfillmentState.UNKNOWN)
        rows = (
            Purchase.objects.order_by()
            .values("payment_state")
            .annotate(count=Count("pk"), unknown=Count("pk", filter=unknown))
        )
        # Every state is exported, zeros included, so alert rules never see a series vanish.
        counts = dict.fromkeys(Purchase.PaymentState.values, 0)
        unknown_total = 0
        for row in rows:
            counts[row["payment_state"]] = row["count"]
            unknown_total += row["unknown"]
        for state, count in counts.items():
            families["tollbooth_purchases_by_payment_state"].add_metric([state], count)
        families["tollbooth_unknown_executions"].add_metric([], unknown_total)

    def _refunds(self, families: dict[str, GaugeMetricFamily]) -> None:
        rows = (
            Refund.objects.filter(state=Refund.State.OWED)
            .order_by("asset")
            .values("asset")
            .annotate(count=Count("pk"), total=Sum("amount"))
        )
        for row in rows:
            families["tollbooth_refunds_owed"].add_metric([row["asset"]], row["count"])
            # int() keeps the sum exact (PostgreSQL returns numeric) until the exposition.
            families["tollbooth_refunds_owed_amount"].add_metric([row["asset"]], int(row["total"]))

    def _escalations(self, families: dict[str, GaugeMetricFamily], now: datetime) -> None:
        rows = (
            Escalation.objects.filter(state=Escalation.State.OPEN)
            .order_by()
            .values("owner")
            .annotate(open=Count("pk"), overdue=Count("pk", filter=Q(deadline_at__lt=now)))
        )
        found = {row["owner"]: row for row in rows}
        for owner in Escalation.OwnerRole.values:
            row = found.get(owner, {"open": 0, "overdue": 0})
            families["tollbooth_escalations_open"].add_metric([owner], row["open"])
            families["tollbooth_escalations_overdue"].add_metric([owner], row["overdue"])

    def _jobs(self, families: dict[str, GaugeMetricFamily], now: datetime) -> None:
        succeeded = Q(finished_at__isnull=False, error="")
        rows = (
            # Ordering only by the grouped column: Meta.ordering would split the GROUP BY.
            JobRun.objects.order_by("job")
            .values("job")
            .annotate(
                last_success=Max("finished_at", filter=succeeded),
                first_start=Min("started_at"),
                last_start=Max("started_at"),
            )
        )
        for row in rows:
            # A job that never succeeded has been lagging since it first tried.
            since = row["last_success"] or row["first_start"]
            families["tollbooth_job_lag_seconds"].add_metric([row["job"]], _age_seconds(now, since))
            families["tollbooth_job_last_run_timestamp_seconds"].add_metric(
                [row["job"]], row["last_start"].timestamp()
            )

    def _outbox(self, families: dict[str, GaugeMetricFamily], now: datetime) -> None:
        waiting = OutboxMessage.objects.filter(OUTBOX_WAITING).aggregate(
            count=Count("pk"), oldest=Min("created_at")
        )
        oldest = waiting["oldest"]
        families["tollbooth_outbox_backlog"].add_metric([], waiting["count"])
        families["tollbooth_outbox_oldest_unrelayed_age_seconds"].add_metric(
            [], _age_seconds(now, oldest) if oldest is not None else 0.0
        )

    def _webhooks(self, families: dict[str, GaugeMetricFamily], now: datetime) -> None:
        pending = Q(state=WebhookDelivery.State.PENDING)
        counts = WebhookDelivery.objects.aggregate(
            **{state: Count("pk", filter=Q(state=state)) for state in WebhookDelivery.State.values},
            oldest=Min("created_at", filter=pending),
            failing=Count(
                "endpoint",
                distinct=True,
                filter=pending
                & Q(
                    endpoint__enabled=True,
                    endpoint__failing_since__lte=now - FAILING_ALERT_AFTER,
                ),
            ),
        )
        for state in WebhookDelivery.State.values:
            families["tollbooth_webhook_deliveries"].add_metric([state], counts[state])
        oldest = counts["oldest"]
        families["tollbooth_webhook_oldest_pending_age_seconds"].add_metric(
            [], _age_seconds(now, oldest) if oldest is not None else 0.0
        )
        families["tollbooth_webhook_endpoints_failing"].add_metric([], counts["failing"])

    def _relayer_gas(self, families: dict[str, GaugeMetricFamily]) -> None:
        rows = RelayerGas.objects.order_by("network", "address").values_list(
            "network", "address", "balance", "minimum", "read_at"
        )
        for network, address, balance, minimum, read_at in rows:
            labels = [network, address]
            # int() keeps wei exact (a Decimal from the database) until the exposition.
            families["tollbooth_relayer_gas_balance_wei"].add_metric(labels, int(balance))
            families["tollbooth_relayer_gas_minimum_wei"].add_metric(labels, int(minimum))
            families["tollbooth_relayer_gas_read_timestamp_seconds"].add_metric(
                labels, read_at.timestamp()
            )


class CountersCollector(Collector):
    """The in-process counters: summed over every process of the host when they share a
    multiprocess directory (read at each scrape: a process that died keeps its counts), else
    this process's own, with its process and platform metrics (the default registry)."""

    def collect(self) -> Iterable[Metric]:
        directory = settings.TOLLBOOTH_METRICS_PROCESS_DIR
        if not directory:
            yield from REGISTRY.collect()
            return
        yield from MultiProcessCollector(None, path=directory).collect()
        yield from PLATFORM_COLLECTOR.collect()


tollbooth_collector = TollboothCollector()
registry = CollectorRegistry()
registry.register(tollbooth_collector)
registry.register(CountersCollector())


def _is_authorized(request: HttpRequest) -> bool:
    token = getattr(settings, "TOLLBOOTH_METRICS_TOKEN", "")
    if not token:
        return True
    sent = request.headers.get("Authorization", "")
    return secrets.compare_digest(sent.encode(), f"Bearer {token}".encode())


@require_safe
def metrics_view(request: HttpRequest) -> HttpResponse:
    if not _is_authorized(request):
        response = HttpResponse("unauthorized\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
