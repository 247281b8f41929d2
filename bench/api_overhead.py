"""Two figures of the agent API, served by gunicorn as production serves it (bench/server.py):

- **replay vs a bare endpoint**: a prepaid pay request replayed (same Idempotency-Key, same
  body) against a DRF endpoint with the same API-key authentication that answers a constant
  JSON body. Requests per second, ratio; goal >= 0.8.
- **prepaid purchase vs a one-INSERT endpoint**: quote + pay through the real API against a
  DRF endpoint with the same authentication that INSERTs the quote-shaped body as one row.
  A purchase counts as its two HTTP calls; HTTP calls per second, ratio; goal >= 0.3.

Each repeat measures the anchor and ours back to back, the order rotated every repeat, so
the shared machine's load falls on both sides of the ratio. Load: the plan's client
processes of threads (bench/load_client.py), one agent (its own buyer and API key) per
thread. A third line, a diagnostic with no goal, replays through the same view without its
throttles. docs/benchmarks.md describes it all and records the figures.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection

from bench.common import Figure, Scale
from bench.server import ROOT, Server, cpu_seconds, gunicorn
from fulfillment.executors.report import REPORT_INPUT_SCHEMA
from payments.models import LedgerEntry
from payments.services import ledger_credit
from purchases.models import Offering
from purchases.services.shared.buyers import api_key_issue, buyer_create

OFFERING_SLUG = "bench-report"
BALANCE = 10**15  # atomic units: no run drains it


@dataclass(frozen=True)
class Plan:
    repeats: int
    agents: int  # concurrent agents (client threads), one API key each
    client_processes: int
    warmup: float
    duration: float
    web_workers: int | None = None  # None: config/gunicorn.py's default (the CPU count)
    prime_every_scenario: bool = True


PLANS = {
    # gunicorn has 2 processes x 8 threads: 16 agents keep every thread busy.
    Scale.FULL: Plan(repeats=5, agents=16, client_processes=2, warmup=2.0, duration=8.0),
    # Proves the bench runs, nothing more: one web process boots faster on a busy machine.
    Scale.SMOKE: Plan(
        repeats=1,
        agents=4,
        client_processes=1,
        warmup=0.3,
        duration=1.0,
        web_workers=1,
        prime_every_scenario=False,
    ),
}


@dataclass(frozen=True)
class Rate:
    calls_per_second: float
    units_per_second: float
    server_cpu_ms: float  # gunicorn CPU per HTTP call
    database_cpu_ms: float  # PostgreSQL backends' CPU per HTTP call
    client_cpu_ms: float  # the load generator's CPU per HTTP call (it shares the cores)

    @property
    def cost_ms(self) -> float:
        return max(1e-6, self.server_cpu_ms + self.database_cpu_ms)

    def describe(self) -> str:
        return (
            f"{self.calls_per_second:.0f} req/s, "
            f"CPU/req {self.server_cpu_ms:.2f} ms app + {self.database_cpu_ms:.2f} db "
            f"+ {self.client_cpu_ms:.2f} client"
        )


def _agents(count: int) -> list[dict[str, str]]:
    agents = []
    for index in range(count):
        buyer = buyer_create(name=f"bench-agent-{uuid.uuid4().hex[:8]}-{index}")
        ledger_credit(
            buyer_id=buyer.pk,
            asset=_offering().asset,
            amount=BALANCE,
            kind=LedgerEntry.Kind.TOP_UP,
            reference=f"bench-top-up:{buyer.ref}",
        )
        agents.append({"api_key": api_key_issue(buyer=buyer, label="bench")})
    return agents


def _offering() -> Offering:
    offering, _ = Offering.objects.get_or_create(
        slug=OFFERING_SLUG,
        defaults={
            "title": "Bench CSV report",
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


def _database_pids() -> dict[int, float]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()"
        )
        pids = [row[0] for row in cursor.fetchall()]
    return {pid: cpu_seconds([pid]) for pid in pids}


def _measure(
    server: Server, plan: Plan, agents: list[dict[str, str]], spec: dict[str, Any]
) -> Rate:
    """Run the client processes once against the server; the window's rate and CPU cost."""
    per_process = [agents[i :: plan.client_processes] for i in range(plan.client_processes)]
    setup = 1.0 if spec["scenario"] == "replay" else 0.0
    profilers = _profilers(server, spec, setup + plan.warmup + plan.duration)
    app_before = cpu_seconds(server.pids())
    client_before = _children_cpu()
    db_before = _database_pids()
    clients = []
    for index, share in enumerate(per_process):
        body = {
            **spec,
            "base_url": server.url,
            "agents": share,
            "process": index,
            "run": uuid.uuid4().hex[:12],
            "offering": OFFERING_SLUG,
            "setup": setup,
            "warmup": plan.warmup,
            "duration": plan.duration,
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.load_client"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdin is not None
        process.stdin.write(json.dumps(body))
        process.stdin.close()
        clients.append(process)
    outputs = []
    for process in clients:
        assert process.stdout is not None
        out = process.stdout.read()
        if process.wait() != 0:
            raise RuntimeError(f"load client failed ({spec['scenario']})")
        outputs.append(json.loads(out))
    app_cpu = cpu_seconds(server.pids()) - app_before
    client_cpu = _children_cpu() - client_before
    for profiler in profilers:
        profiler.wait()
    db_after = _database_pids()
    db_cpu = sum(cpu for pid, cpu in db_after.items()) - sum(
        cpu for pid, cpu in db_before.items() if pid in db_after
    )
    errors = sum(o["errors"] for o in outputs)
    if errors:
        samples = [s for o in outputs for s in o["samples"]]
        raise RuntimeError(f"{spec['scenario']}: {errors} unexpected answers, e.g. {samples[:3]}")
    calls = sum(o["calls"] for o in outputs)
    if not calls and plan.repeats:
        raise RuntimeError(f"{spec['scenario']}: no call completed inside the window")
    units = sum(o["units"] for o in outputs)
    # CPU was sampled over setup + warmup + window: spread it over every call made then.
    window_share = plan.duration / (setup + plan.warmup + plan.duration)
    all_calls = max(1.0, calls / window_share)
    return Rate(
        calls_per_second=calls / plan.duration,
        units_per_second=units / plan.duration,
        server_cpu_ms=1000 * app_cpu / all_calls,
        database_cpu_ms=1000 * db_cpu / all_calls,
        client_cpu_ms=1000 * client_cpu / all_calls,
    )


def _children_cpu() -> float:
    """CPU of this process's finished children: the load clients, once waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _profilers(
    server: Server, spec: dict[str, Any], seconds: float
) -> list[subprocess.Popen[bytes]]:
    """With BENCH_PROFILE=<scenario> (replay, post, purchase, insert), py-spy records each
    gunicorn worker through that scenario's next measurement: var/bench/profile-*.txt, in
    collapsed-stack form (one stack and its sample count a line)."""
    if os.environ.get("BENCH_PROFILE") != spec["scenario"]:
        return []
    out_dir = Path(settings.VAR_DIR) / "bench"
    return [
        subprocess.Popen(
            [
                str(Path(sys.executable).parent / "py-spy"),
                "record",
                "--pid",
                str(pid),
                "--duration",
                str(int(seconds)),
                "--format",
                "raw",
                "--rate",
                "200",
                "--output",
                str(out_dir / f"profile-{spec['scenario']}-{pid}.txt"),
                # BENCH_PROFILE_GIL=1: only the thread holding the GIL, i.e. Python's CPU.
                *(["--gil"] if os.environ.get("BENCH_PROFILE_GIL") else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for pid in server.pids()[1:]
    ]


REPLAY: dict[str, Any] = {"scenario": "replay", "pay_prefix": "/api/v1/quotes"}
REPLAY_UNTHROTTLED = {"scenario": "replay", "pay_prefix": "/bench/unthrottled/quotes"}
BARE = {"scenario": "post", "path": "/bench/bare", "body": '{"rail": "prepaid"}', "expect": 200}
PURCHASE = {"scenario": "purchase"}
ONE_INSERT = {"scenario": "insert", "path": "/bench/insert"}


def run(scale: Scale) -> list[Figure]:
    plan = PLANS[scale]
    _offering()
    agents = _agents(plan.agents)
    connection.close()  # idle through the run; the server holds its own connections
    log_dir = Path(settings.VAR_DIR) / "bench"
    # Measured back to back in each repeat, the order rotated from one repeat to the next,
    # so a drift in the shared machine's load falls on every side of a ratio.
    groups: list[dict[str, dict[str, Any]]] = [
        {"bare": BARE, "replay": REPLAY, "replay_unthrottled": REPLAY_UNTHROTTLED},
        {"insert": ONE_INSERT, "purchase": PURCHASE},
    ]
    rates: dict[str, list[Rate]] = {name: [] for group in groups for name in group}
    with gunicorn(log_dir, workers=plan.web_workers) as server:
        # Unmeasured: each worker's first requests import the URLconf and views, and open
        # its persistent database connections (seconds on a busy machine).
        # (Every agent finishes the call it started, so each makes at least one; repeats=0
        # marks the plan as unmeasured.)
        priming = Plan(0, plan.agents, plan.client_processes, warmup=0.0, duration=1.0)
        for group in groups:
            for spec in group.values() if plan.prime_every_scenario else [BARE]:
                _measure(server, priming, agents, spec)
        for repeat in range(plan.repeats):
            for group in groups:
                names = list(group)
                shift = repeat % len(names)
                for name in names[shift:] + names[:shift]:
                    rates[name].append(_measure(server, plan, agents, group[name]))
    workers = plan.web_workers or os.environ.get("GUNICORN_WORKERS", str(os.cpu_count() or 2))
    threads = os.environ.get("GUNICORN_THREADS", "8")
    shape = (
        f"gunicorn gthread {workers}x{threads}, {plan.agents} agents on "
        f"{plan.client_processes} client process(es), {plan.duration:g} s windows"
    )
    bare = "bare DRF endpoint, same API-key auth, constant JSON"
    return [
        _figure(
            "replay vs bare endpoint",
            list(zip(rates["bare"], rates["replay"], strict=True)),
            ">= 0.8",
            "replayed prepaid pay (same key, same body)",
            bare,
            shape,
        ),
        _figure(
            "prepaid purchase vs one-INSERT endpoint",
            list(zip(rates["insert"], rates["purchase"], strict=True)),
            ">= 0.3",
            "quote + pay, a purchase = 2 HTTP calls",
            "DRF endpoint, same API-key auth, one INSERT",
            shape,
            per_unit="purchases/s",
        ),
        # No goal: says how much of the replay's gap the throttle (one Redis round trip) is.
        _figure(
            "(diagnostic) replay without throttles vs bare endpoint",
            list(zip(rates["bare"], rates["replay_unthrottled"], strict=True)),
            "",
            "the same replay, the same view mounted without its throttle classes",
            bare,
            shape,
        ),
    ]


def _figure(
    name: str,
    pairs: list[tuple[Rate, Rate]],
    goal: str,
    ours_label: str,
    anchor_label: str,
    shape: str,
    per_unit: str = "",
) -> Figure:
    ratios = [ours.calls_per_second / anchor.calls_per_second for anchor, ours in pairs]
    median_pair = sorted(pairs, key=lambda p: p[1].calls_per_second / p[0].calls_per_second)[
        len(pairs) // 2
    ]
    anchor, ours = median_pair
    units = f" ({ours.units_per_second:.0f} {per_unit})" if per_unit else ""
    # The same comparison in server CPU (app + database) per request: how much of the
    # shared cores each side needs, whatever share of them it got while measured.
    cost_ratios = sorted(a.cost_ms / o.cost_ms for a, o in pairs)
    detail = (
        f"ours: {ours_label}: {ours.describe()}{units}; "
        f"anchor: {anchor_label}: {anchor.describe()}; {shape} (median repeat); "
        f"CPU-cost ratio (anchor/ours, app+db per req) median {statistics.median(cost_ratios):.2f}"
    )
    extra = {
        "ours_req_per_s": ",".join(f"{o.calls_per_second:.1f}" for _, o in pairs),
        "anchor_req_per_s": ",".join(f"{a.calls_per_second:.1f}" for a, _ in pairs),
        "ours_app_cpu_ms": ",".join(f"{o.server_cpu_ms:.2f}" for _, o in pairs),
        "anchor_app_cpu_ms": ",".join(f"{a.server_cpu_ms:.2f}" for a, _ in pairs),
        "ours_db_cpu_ms": ",".join(f"{o.database_cpu_ms:.2f}" for _, o in pairs),
        "anchor_db_cpu_ms": ",".join(f"{a.database_cpu_ms:.2f}" for a, _ in pairs),
        "ours_client_cpu_ms": ",".join(f"{o.client_cpu_ms:.2f}" for _, o in pairs),
        "anchor_client_cpu_ms": ",".join(f"{a.client_cpu_ms:.2f}" for a, _ in pairs),
        "cpu_cost_ratios": ",".join(f"{a.cost_ms / o.cost_ms:.3f}" for a, o in pairs),
    }
    return Figure(name=name, ratios=ratios, goal=goal, detail=detail, extra=extra)
