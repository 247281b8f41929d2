"""`make bench-hosts`: the production shape across hosts, against the one-host shape, and
hosts cut off the network mid-load (issue 22, section 3; docs/deployment.md).

    sudo make bench-hosts                        # 3 repeats, then a web and a worker fault
    .venv/bin/python bench/hosts.py --scale smoke   # 1 repeat of a few calls, one web fault
    .venv/bin/python bench/hosts.py --repeats 5 --calls 5 --delay-ms 3 --faults web,worker

Hosts (network namespaces, bench/hosts_net.py): lb (HAProxy), web1 and web2 (`serve.py
web`), worker1 (`serve.py worker beat`) and worker2 (`serve.py worker`), db (a private
PostgreSQL from initdb and a private Redis); the chain (anvil) and the agents in the root
namespace. A delay proxy (bench/delay_proxy.c, `--delay-ms` each way) on every link.
The one-host shape is `serve.py web worker` on the db host itself, talking to PostgreSQL
and Redis over loopback; both shapes share the database, the chain and the relayer key,
and take turns (the order rotated every repeat), so both see the same chain.

The agents: 32 threads, each the official x402 client with a wallet of its own (new
wallets every window) and the SDK's payment-identifier hook: a call that fails (a reset, a
timeout, a 409 while the payment id is in flight elsewhere) is retried with the same
payment id until it is answered 200, or 202 with a status URL, which is then polled until
it resolves. After each window: transfers on chain from the window's wallets (0 charged
twice: one per call), execution attempts and results per purchase (0 run twice).

Prints one table (var/bench/hosts.json too); exits 1 when a fault check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(ROOT))

from bench import hosts_net as net  # noqa: E402
from bench.common import Figure  # noqa: E402
from bench.hosts_agents import SLUG, Agent, Call, drive, recover  # noqa: E402
from bench.hosts_deploy import (  # noqa: E402
    DATABASE,
    HOSTS,
    ONE_HOST,
    Deployment,
    deployment_up,
    shape_url,
    wait_ready,
    wait_workers,
    worker_host_start,
)

AGENTS = 32
TRANSFER_TOPIC = "0xddf252ad1be2c89b69c2b068fc378daa952ba7f163c4a11628f55a4df523b3ef"


# --- a window and its checks ---------------------------------------------------------------
@dataclass
class Window:
    shape: str
    calls: list[Call]
    wall: float
    fault: str = ""
    checks: dict[str, int] = field(default_factory=dict)
    cut_at: float = 0.0  # perf_counter when the host was cut off

    @property
    def answered(self) -> list[Call]:
        return [c for c in self.calls if c.status == 200]

    @property
    def throughput(self) -> float:
        return len(self.answered) / self.wall if self.wall else 0.0

    @property
    def p50(self) -> float:
        latencies = [c.latency for c in self.answered]
        return statistics.median(latencies) if latencies else float("inf")

    def summary(self) -> str:
        statuses = Counter(a for c in self.calls for a in c.attempts)
        retried = sum(1 for c in self.calls if len(c.attempts) > 1)
        return (f"{self.throughput:.2f} calls/s, p50 {self.p50:.3f} s, {len(self.calls)} calls, "
                f"{retried} retried, answers {dict(statuses)}")  # fmt: skip


def run_window(
    deployment: Deployment, shape: str, calls: int, fault: str = "", cut_after: float = 2.0
) -> Window:
    wallets = deployment.take_wallets(AGENTS)
    agents = [Agent(w, deployment.token, f"a{i}") for i, w in enumerate(wallets)]
    base = shape_url(shape)
    url = f"{base}/x402/{SLUG}"
    outcome: dict[str, Any] = {}

    def load() -> None:
        outcome["calls"], outcome["wall"] = drive(url, agents, calls)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    cut_at = 0.0
    if fault:
        time.sleep(cut_after)
        cut_at = time.perf_counter()
        fault_start(deployment, fault)
    thread.join()
    if fault:
        fault_end(deployment, fault)
    window = Window(shape, outcome["calls"], outcome["wall"], fault, cut_at=cut_at)
    recover(base, window.calls)
    window.checks = check(deployment, window, [w.address for w in wallets])
    return window


def fault_start(deployment: Deployment, fault: str) -> None:
    """web: web1 cut off the network, its processes running on; worker: worker2's
    processes killed (-9) and its link taken down."""
    if fault == "web":
        net.link_set("web1", up=False)
    elif fault == "worker":
        deployment.processes.stop_host("worker2", hard=True)
        net.link_set("worker2", up=False)
    print(f"bench.hosts: {fault} host cut off at {datetime.now(UTC):%H:%M:%S}", file=sys.stderr)


def fault_end(deployment: Deployment, fault: str) -> None:
    """Recovery: the link back; the killed worker host restarted, as its supervisor would."""
    if fault == "web":
        net.link_set("web1", up=True)
        wait_ready(f"http://{net.address('web1')}:{net.WEB_PORT}/readyz")
        wait_ready(f"http://{net.address('web1')}:{net.ASGI_WEB_PORT}/readyz")
    elif fault == "worker":
        net.link_set("worker2", up=True)
        worker_host_start(deployment, "worker2", beat=False)
        wait_workers(deployment, ["worker2"])


def check(deployment: Deployment, window: Window, payers: list[str]) -> dict[str, int]:
    """After recovery: what the chain and the database say about the window's calls."""
    import psycopg

    transfers = Counter(_transfers_from(deployment, payers))
    calls = Counter(c.payer.lower() for c in window.calls)
    url = f"postgres://postgres@{net.address('db')}:{net.PG_PORT}/{DATABASE}"
    lowered = [p.lower() for p in payers]
    with psycopg.connect(url) as conn:
        purchases = conn.execute(
            "SELECT id FROM purchases_purchase WHERE lower(payer) = ANY(%s)", [lowered]
        ).fetchall()
        ids = [row[0] for row in purchases]
        executions = conn.execute(
            "SELECT purchase_id, count(*) FROM fulfillment_executionattempt "
            "WHERE purchase_id = ANY(%s) GROUP BY purchase_id HAVING count(*) > 1",
            [ids],
        ).fetchall()
        results = conn.execute(
            "SELECT purchase_id, count(*) FROM fulfillment_result "
            "WHERE purchase_id = ANY(%s) GROUP BY purchase_id HAVING count(*) > 1",
            [ids],
        ).fetchall()
    unanswered = [c for c in window.calls if c.status not in (200, 202)]
    unresolved = [c for c in window.calls if c.status == 202 and c.resolved is None]
    last = max((c.answered_at for c in window.calls if c.done), default=window.cut_at)
    return {
        "calls": len(window.calls),
        "purchases": len(ids),
        "transfers": sum(transfers.values()),
        # More transfers from a payer than calls it made: a call charged twice.
        "charged_twice": sum(max(0, transfers[p] - calls[p]) for p in calls | transfers),
        "run_twice": len(executions) + len(results),
        "unanswered": len(unanswered),
        "answered_202": sum(1 for c in window.calls if c.status == 202),
        "unresolved": len(unresolved),
        # Seconds from the cut to the last call answered (its 202 resolved), recovery included.
        "last_answer_after_cut_s": round(last - window.cut_at) if window.cut_at else 0,
    }


def _transfers_from(deployment: Deployment, payers: list[str]) -> list[str]:
    seller = "0x" + deployment.seller.lower()[2:].rjust(64, "0")
    topics = ["0x" + p.lower()[2:].rjust(64, "0") for p in payers]
    logs = deployment.node.rpc("eth_getLogs", [{
        "address": deployment.token, "fromBlock": "0x0", "toBlock": "latest",
        "topics": [TRANSFER_TOPIC, topics, seller],
    }])  # fmt: skip
    return ["0x" + log["topics"][1][-40:] for log in logs]


def failed_checks(window: Window) -> list[str]:
    c = window.checks
    wrong = [name for name in ("charged_twice", "run_twice", "unanswered", "unresolved") if c[name]]
    if c["transfers"] != c["calls"] or c["purchases"] != c["calls"]:
        wrong.append(f"{c['transfers']} transfers and {c['purchases']} purchases "
                     f"for {c['calls']} calls")  # fmt: skip
    return wrong


# --- the figures -----------------------------------------------------------------------------
def figures(windows: list[Window], load: tuple[float, float]) -> list[Figure]:
    one = [w for w in windows if w.shape == ONE_HOST and not w.fault]
    hosts = [w for w in windows if w.shape == HOSTS and not w.fault]
    detail = (f"across hosts {'; '.join(w.summary() for w in hosts)} | one host "
              f"{'; '.join(w.summary() for w in one)} | load average {load[0]:.1f} to "
              f"{load[1]:.1f}")  # fmt: skip
    out = []
    if one and hosts:
        out += [
        Figure("x402 paid call across hosts / one host: throughput, 32 agents",
               [h.throughput / o.throughput if o.throughput else 0.0
                for h, o in zip(hosts, one, strict=True)],
               goal=">= 0.7", detail=detail),
        Figure("x402 paid call across hosts / one host: p50 latency, 32 agents",
               [h.p50 / o.p50 for h, o in zip(hosts, one, strict=True)],
               goal="<= 1.3", detail=detail),
        ]  # fmt: skip
    for window in (w for w in windows if w.fault):
        wrong = failed_checks(window)
        c = window.checks
        out.append(Figure(
            f"{window.fault} host cut off mid-load: calls answered (200, or 202 resolved)",
            [(c["calls"] - c["unanswered"] - c["unresolved"]) / max(c["calls"], 1)],
            goal=">= 1.0",
            detail=(f"{window.summary()}; {c['transfers']} transfers, {c['purchases']} "
                    f"purchases for {c['calls']} calls; {c['charged_twice']} charged twice, "
                    f"{c['run_twice']} run twice, {c['answered_202']} answered 202, "
                    f"{c['unresolved']} unresolved; the last answered "
                    f"{c['last_answer_after_cut_s']} s after the cut; "
                    + ("FAILED: " + ", ".join(wrong) if wrong else "all checks hold")),
        ))  # fmt: skip
    return out


@dataclass(frozen=True)
class Plan:
    repeats: int
    calls: int
    fault_calls: int
    faults: tuple[str, ...]


PLANS = {
    "smoke": Plan(repeats=1, calls=1, fault_calls=2, faults=("web",)),
    "full": Plan(repeats=3, calls=5, fault_calls=6, faults=("web", "worker")),
}


def measure(
    plan: Plan, delay_ms: float, workdir: Path, one_host_workers: int = 0, web_host_workers: int = 0
) -> list[Window]:
    windows_count = 2 * plan.repeats + len(plan.faults)
    windows: list[Window] = []
    wallets = AGENTS * (windows_count + 1)
    with deployment_up(
        workdir, delay_ms, wallets, one_host_workers, web_host_workers
    ) as deployment:
        warm = deployment.take_wallets(AGENTS)[:2]  # imports, connections, first queries
        for shape in (ONE_HOST, HOSTS):
            agents = [Agent(w, deployment.token, f"warm{i}") for i, w in enumerate(warm)]
            drive(f"{shape_url(shape)}/x402/{SLUG}", agents, 1)
        shapes = [ONE_HOST, HOSTS]
        for repeat in range(plan.repeats):
            for shape in shapes[repeat % 2 :] + shapes[: repeat % 2]:
                window = run_window(deployment, shape, plan.calls)
                windows.append(window)
                _progress(f"repeat {repeat + 1}, {shape}", window)
        for fault in plan.faults:
            window = run_window(deployment, HOSTS, plan.fault_calls, fault=fault)
            windows.append(window)
            _progress(f"{fault} fault", window)
    return windows


def _progress(label: str, window: Window) -> None:
    print(f"bench.hosts: {label}: {window.summary()}; checks {window.checks}; load average "
          f"{os.getloadavg()[0]:.1f}", file=sys.stderr)  # fmt: skip


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    from bench.run import Row, table
    from devtools.anvil import block_time_from_env

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", choices=sorted(PLANS), default="full")
    parser.add_argument("--repeats", type=int, help="0: only the faults")
    parser.add_argument("--calls", type=int, help="calls per agent per window")
    parser.add_argument("--delay-ms", type=float, default=2.0, help="added each way per link")
    parser.add_argument(
        "--one-host-workers", type=int, default=0,
        help="ASGI worker processes of the one-host shape (default: the CPU count; 4: as "
        "many as both web hosts)",
    )  # fmt: skip
    parser.add_argument(
        "--web-host-workers", type=int, default=0,
        help="ASGI worker processes of each web host (default: the CPU count; 1: both web "
        "hosts together as many as the one host, the cores being shared)",
    )  # fmt: skip
    parser.add_argument(
        "--proxy", choices=("c", "python"), default="c",
        help="the delay proxies: bench/delay_proxy.c (built with the system's C compiler; "
        "the Python one where there is none) or bench/delay_proxy.py",
    )  # fmt: skip
    parser.add_argument("--faults", help="comma-separated: web, worker (none: '')")
    parser.add_argument("--json", type=Path, default=ROOT / "var" / "bench" / "hosts.json")
    args = parser.parse_args(argv)
    missing = net.missing_requirements()
    if missing:
        print("bench.hosts: cannot run here; missing:", *missing, sep="\n  ", file=sys.stderr)
        return 2
    plan = PLANS[args.scale]
    plan = Plan(
        repeats=plan.repeats if args.repeats is None else args.repeats,
        calls=args.calls or plan.calls,
        fault_calls=plan.fault_calls,
        faults=tuple(f for f in args.faults.split(",") if f) if args.faults is not None
        else plan.faults,
    )  # fmt: skip
    signal.signal(signal.SIGTERM, _interrupt)  # cleaned up as on Ctrl-C
    os.environ["BENCH_HOSTS_PROXY"] = args.proxy  # read by hosts_net.delay_proxy
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-hosts-") as tmp:
        workdir = Path(tmp)
        try:
            windows = measure(
                plan, args.delay_ms, workdir, args.one_host_workers, args.web_host_workers
            )
        except BaseException:
            for log in sorted(workdir.glob("*.log")):
                print(f"--- {log.name} (tail) ---\n{log.read_text(errors='replace')[-2000:]}",
                      file=sys.stderr)  # fmt: skip
            raise
        finally:  # every host's log, kept for reading after the run
            kept = args.json.parent / "hosts-logs"
            shutil.rmtree(kept, ignore_errors=True)
            kept.mkdir(parents=True)
            for log in workdir.glob("*.log"):
                shutil.copy(log, kept / log.name)
    load = (load_start, os.getloadavg()[0])
    rows = [Row.of("bench.hosts", figure) for figure in figures(windows, load)]
    print(table(rows))
    workers = (f"ASGI workers: {args.web_host_workers or 'the CPU count'} per web host, "
               f"{args.one_host_workers or 'the CPU count'} on the one host")  # fmt: skip
    block_time = block_time_from_env()
    chain = f"{block_time:g} s blocks" if block_time else "automine"
    print(f"\n{args.scale} run, {plan.repeats} repeats, {AGENTS} agents, {chain}, "
          f"{args.delay_ms:g} ms each way per link ({args.proxy} proxies); {workers}; load "
          f"average {load[0]:.2f} at start, {load[1]:.2f} at end (2 cores, shared)")  # fmt: skip
    failures = [f"{w.fault}: {', '.join(failed_checks(w))}" for w in windows
                if w.fault and failed_checks(w)]  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average": load, "delay_ms": args.delay_ms, "proxy": args.proxy,
        "block_time_s": block_time, "repeats": plan.repeats,
        "figures": [row.__dict__ for row in rows],
        "fault_checks": {w.fault: w.checks for w in windows if w.fault},
    }, indent=2) + "\n")  # fmt: skip
    for failure in failures:
        print(f"bench.hosts: FAULT CHECK FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
