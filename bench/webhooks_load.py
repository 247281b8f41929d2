"""Webhooks under load (issue 33, part 1; docs/benchmarks.md, "Purchases with webhooks, one
endpoint dead and one slow"): a slow or dead endpoint never slows a purchase, and nothing is
lost.

    .venv/bin/python bench/run.py --only bench.webhooks_load            # full: a few minutes
    .venv/bin/python bench/run.py --only bench.webhooks_load --scale smoke

A real Celery worker (prefork, 2 processes, with beat) delivers, as deployed, to three local
receivers (each in its own process: bench/webhook_receiver.py): one that answers at once,
one that answers after SLOW seconds, and one dead (its
port refuses every connection). This process buys prepaid purchases in-process (quote, then
pay: the purchase's path, with its executor), timing each. Runs alternate: with webhooks
(the three endpoints enabled: every purchase writes its events and their outbox messages,
while the worker publishes and delivers them) and without (once the worker has published
every event and the live endpoints have theirs, the endpoints are disabled: no event is
written and the worker sends nothing; the dead endpoint's deliveries wait). The figure is
each pair's p50 with over p50 without; goal 1.05.

Then the dead endpoint comes back (a receiver on its port; an admin's "Enable" makes its
waiting deliveries due at once) and the bench waits until every delivery is delivered:
each receiver must have every event's id, none failed, none pending.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import connection

from bench.common import Figure, Scale
from bench.server import ROOT, free_port
from doors.rest.prepaid_answers import PrepaidAnswers
from fulfillment.executors.report import REPORT_INPUT_SCHEMA
from payments.models import LedgerEntry
from payments.services import ledger_credit
from purchases.models import Buyer, Offering
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from purchases.services.quote.quotes import quote_create
from purchases.services.shared.buyers import buyer_create
from webhooks.events import SUBSCRIPTIONS_TTL
from webhooks.models import WebhookDelivery, WebhookEndpoint, WebhookEvent
from webhooks.services import webhook_endpoint_set_enabled

OFFERING_SLUG = "bench-webhooks-report"
BALANCE = 10**15
SECRET_ENV = "TOLLBOOTH_BENCH_WEBHOOK_SECRET"  # noqa: S105 (a variable name)
# Every delivery delivered within this after the dead endpoint is back, or the run fails.
DRAIN_TIMEOUT_SECONDS = 900.0


@dataclass(frozen=True)
class Plan:
    purchases: int  # a run's purchases, each side
    repeats: int  # pairs of runs (with, without), alternating
    slow_seconds: float  # how long the slow endpoint takes to answer


PLANS = {
    Scale.SMOKE: Plan(purchases=3, repeats=1, slow_seconds=0.05),
    # 5 x 100 purchases with webhooks, two events each (paid, succeeded): 1,000 events.
    Scale.FULL: Plan(purchases=100, repeats=5, slow_seconds=0.1),
}


@dataclass
class Receiver:
    url: str
    ids_file: Path

    @property
    def ids(self) -> set[str]:
        if not self.ids_file.exists():
            return set()
        return set(self.ids_file.read_text().split())


@contextmanager
def _receiving(log_dir: Path, delay: float = 0.0, port: int = 0) -> Iterator[Receiver]:
    """A receiver in its own process (bench/webhook_receiver.py)."""
    port = port or free_port()
    ids_file = log_dir / f"received-{port}.txt"
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.webhook_receiver", str(port), str(delay), str(ids_file)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        if process.stdout.readline().strip() != b"ready":
            raise RuntimeError("bench: the webhook receiver did not start")
        yield Receiver(url=f"http://127.0.0.1:{port}/hooks", ids_file=ids_file)
    finally:
        process.terminate()
        process.wait(timeout=30)


def _connection_url() -> str:
    db = connection.settings_dict
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    auth = f"{db['USER']}{password}@" if db.get("USER") else ""
    host, port = db.get("HOST") or "127.0.0.1", db.get("PORT") or 5432
    return f"postgres://{auth}{host}:{port}/{db['NAME']}"


@contextmanager
def _worker(log_dir: Path) -> Iterator[None]:
    """A Celery worker with beat on the bench's queue, as deployed (prefork)."""
    args = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "config",
        "worker",
        "--concurrency",
        "2",
        "--beat",
        "--schedule",
        str(log_dir / "beat-schedule"),
        "--without-gossip",
        "--without-mingle",
        "--loglevel",
        "WARNING",
        "-Q",
        settings.CELERY_TASK_DEFAULT_QUEUE,
    ]
    # The database this process writes to, named from its connection: another bench of the
    # same run may have left DATABASE_URL naming its own (bench/scale.py does).
    env = {
        **os.environ,
        "DATABASE_URL": _connection_url(),
        "TOLLBOOTH_VAR_DIR": str(log_dir / "var"),
    }
    with (log_dir / "worker.log").open("wb") as log:
        process = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _offering() -> Offering:
    offering, _ = Offering.objects.get_or_create(
        slug=OFFERING_SLUG,
        defaults={
            "title": "Bench CSV report (webhooks)",
            "executor": "report",
            "price": 250_000,
            "asset": "0x" + "0" * 38 + "dc",
            "network": "eip155:31337",
            "pay_to": "0x" + "5e" * 20,
            "input_schema": REPORT_INPUT_SCHEMA,
            "result_retention": timedelta(days=7),
        },
    )
    return offering


def _buyer(offering: Offering) -> Buyer:
    buyer = buyer_create(name=f"bench-webhooks-{uuid.uuid4().hex[:8]}")
    ledger_credit(
        buyer_id=buyer.pk,
        asset=offering.asset,
        amount=BALANCE,
        kind=LedgerEntry.Kind.TOP_UP,
        reference=f"bench-top-up:{buyer.ref}",
    )
    return buyer


def _purchases(buyer: Buyer, offering: Offering, count: int, tag: str) -> list[float]:
    """Each purchase's seconds: its quote, then its payment (the executor runs inline)."""
    seconds = []
    for index in range(count):
        raw_input = {"title": f"{tag} {index}", "csv": f"region,units\nnorth,{index}\n"}
        started = time.perf_counter()
        quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input=raw_input).quote
        answer, _ = purchase_pay_prepaid(
            answers=PrepaidAnswers(),
            buyer=buyer,
            quote_id=quote.public_id,
            payment_id=f"bench-webhooks-{tag}-{index:05d}",
        )
        seconds.append(time.perf_counter() - started)
        if answer.status not in (200, 201, 202):
            raise RuntimeError(f"bench purchase refused: {answer.status} {answer.body!r}")
    return seconds


def _set_enabled(endpoints: list[WebhookEndpoint], enabled: bool, settle: bool = True) -> None:
    for endpoint in endpoints:
        webhook_endpoint_set_enabled(
            endpoint_id=endpoint.pk, enabled=enabled, reason="" if enabled else "bench_pause"
        )
    # The worker (which records the succeeded events) reads the subscriptions again within
    # this: from then on both processes agree on whether events are written.
    if settle:
        time.sleep(SUBSCRIPTIONS_TTL + 1.0)


def _wait_drained(buyer: Buyer, endpoints: list[WebhookEndpoint], deadline: float) -> None:
    """Until every event of `buyer` is published and `endpoints` have all theirs."""
    pending = WebhookDelivery.objects.filter(
        endpoint__in=endpoints, state=WebhookDelivery.State.PENDING
    )
    unpublished = WebhookEvent.objects.filter(purchase__buyer=buyer, published_at__isnull=True)
    while pending.exists() or unpublished.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("bench: webhook deliveries still pending at the drain timeout")
        time.sleep(1.0)


def run(scale: Scale) -> list[Figure]:
    plan = PLANS[scale]
    os.environ.setdefault(SECRET_ENV, uuid.uuid4().hex)  # the worker inherits it
    dead_port = free_port()
    WebhookEndpoint.objects.update(enabled=False)  # a previous run's endpoints stay quiet
    offering = _offering()
    buyer = _buyer(offering)
    with tempfile.TemporaryDirectory(prefix="bench-webhooks-") as tmp, ExitStack() as stack:
        fast = stack.enter_context(_receiving(Path(tmp)))
        slow = stack.enter_context(_receiving(Path(tmp), delay=plan.slow_seconds))
        endpoints = [
            WebhookEndpoint.objects.create(url=url, secret_env=SECRET_ENV, key_id="bench")
            for url in (fast.url, slow.url, f"http://127.0.0.1:{dead_port}/hooks")
        ]
        dead = endpoints[2]
        ratios, with_p50, without_p50 = [], [], []
        with _worker(Path(tmp)):
            _purchases(buyer, offering, 3, f"warm-{uuid.uuid4().hex[:6]}")  # unmeasured
            for repeat in range(plan.repeats):
                tag = uuid.uuid4().hex[:6]
                _set_enabled(endpoints, True)
                hooked = statistics.median(_purchases(buyer, offering, plan.purchases, tag + "w"))
                # Published while enabled (a disabled endpoint gets no new deliveries), and
                # the live endpoints' backlog sent: the run without does no webhook work.
                _wait_drained(buyer, endpoints[:2], time.monotonic() + DRAIN_TIMEOUT_SECONDS)
                _set_enabled(endpoints, False)
                bare = statistics.median(_purchases(buyer, offering, plan.purchases, tag + "b"))
                with_p50.append(hooked)
                without_p50.append(bare)
                ratios.append(hooked / bare)
                print(
                    f"  webhooks run {repeat + 1}: p50 {hooked * 1000:.1f} ms with, "
                    f"{bare * 1000:.1f} ms without, ratio {hooked / bare:.3f}",
                    file=sys.stderr,
                )
            _set_enabled(endpoints, True)
            with _receiving(Path(tmp), port=dead_port) as back:
                # The admin's move once an endpoint is back: "Enable" makes its waiting
                # deliveries due at once (otherwise their backoff, at most 6 h, decides).
                came_back = time.monotonic()
                _set_enabled([dead], False, settle=False)
                _set_enabled([dead], True, settle=False)
                _wait_drained(buyer, endpoints, came_back + DRAIN_TIMEOUT_SECONDS)
                drained = time.monotonic() - came_back
                events = set(
                    WebhookEvent.objects.filter(purchase__buyer=buyer).values_list(
                        "public_id", flat=True
                    )
                )
                lost = {
                    name: len(events - receiver.ids)
                    for name, receiver in (("fast", fast), ("slow", slow), ("dead", back))
                }
        failed = WebhookDelivery.objects.filter(
            endpoint__in=endpoints, state=WebhookDelivery.State.FAILED
        ).count()
        delivered = WebhookDelivery.objects.filter(
            endpoint__in=endpoints,
            event__public_id__in=events,
            state=WebhookDelivery.State.DELIVERED,
        ).count()
    if any(lost.values()) or failed or delivered != 3 * len(events):
        raise RuntimeError(f"bench: lost {lost}, failed {failed}, delivered {delivered}")
    return [
        Figure(
            "purchase p50 with webhooks (1 dead, 1 slow) vs without",
            ratios,
            goal="<= 1.05",
            detail=(
                f"p50 with {_ms(with_p50)}; without {_ms(without_p50)}; "
                f"{plan.repeats} x {plan.purchases} purchases each side, alternating; "
                f"{len(events)} events, {delivered} deliveries, all delivered "
                f"{drained:.0f} s after the dead endpoint came back; none lost, none failed; "
                f"slow endpoint {plan.slow_seconds * 1000:.0f} ms"
            ),
            extra={
                "events": str(len(events)),
                "deliveries": str(delivered),
                "drained_seconds": f"{drained:.1f}",
                "slow_endpoint_ms": f"{plan.slow_seconds * 1000:.0f}",
            },
        )
    ]


def _ms(values: list[float]) -> str:
    return "/".join(f"{v * 1000:.1f}" for v in values) + " ms"
