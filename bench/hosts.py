"""`make bench-hosts`: the production shape across hosts, against the one-host shape, and
hosts cut off the network mid-load (issue 22, section 3; docs/deployment.md).

    sudo make bench-hosts                        # 3 repeats, then a web and a worker fault
    .venv/bin/python bench/hosts.py --scale smoke   # 1 repeat of a few calls, one web fault
    .venv/bin/python bench/hosts.py --repeats 5 --calls 5 --delay-ms 3 --faults web,worker

Hosts (network namespaces, bench/hosts_net.py): lb (HAProxy), web1 and web2 (`serve.py
web`), worker1 (`serve.py worker beat`) and worker2 (`serve.py worker`), db (a private
PostgreSQL from initdb and a private Redis); the chain (anvil) and the agents in the root
namespace. A delay proxy (bench/delay_proxy.py, `--delay-ms` each way) on every link.
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
import contextlib
import json
import os
import secrets
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

NETWORK = "eip155:31337"
PRICE = 10_000
FUNDS = 100 * 10**6
SLUG = "bench-report"
CSV = "region,units,price\nnorth,3,1.50\nsouth,5,2.25\neast,8,0.75\nwest,1,9.99\n"
AGENTS = 32
CALL_TIMEOUT = 30.0  # one HTTP attempt; a call retries until ANSWER_DEADLINE
ANSWER_DEADLINE = 240.0
RESOLVE_DEADLINE = 180.0
DATABASE = "tollbooth"
TRANSFER_TOPIC = "0xddf252ad1be2c89b69c2b068fc378daa952ba7f163c4a11628f55a4df523b3ef"
WEB_HOSTS, WORKER_HOSTS = ["web1", "web2"], ["worker1", "worker2"]
ONE_HOST, HOSTS = "one host", "across hosts"


# --- the agents ------------------------------------------------------------------------------
@dataclass
class Call:
    payer: str
    payment_id: str
    started: float
    finished: float = 0.0
    status: int | None = None  # the answer kept: 200, or 202 with status_url
    status_url: str = ""
    resolved: int | None = None  # the status URL's final answer
    attempts: list[str] = field(default_factory=list)

    @property
    def latency(self) -> float:
        return self.finished - self.started


class Agent:
    """One paying agent: the stock client with the SDK's payment-identifier hook."""

    def __init__(self, wallet: Any, token: str, name: str) -> None:
        import requests
        from x402 import x402ClientSync
        from x402.extensions.payment_identifier import append_payment_identifier_to_extensions
        from x402.http.clients.requests import wrapRequestsWithPayment
        from x402.mechanisms.evm.exact import ExactEvmClientScheme

        client = x402ClientSync()
        client.register(NETWORK, ExactEvmClientScheme(signer=wallet))
        client.set_spend_controls({"allowed_assets": [{"network": NETWORK, "asset": token}]})

        def add_payment_id(context: Any) -> None:
            extensions = context.payment_required.extensions
            if extensions is not None:
                append_payment_identifier_to_extensions(extensions, self.payment_id)

        client.on_before_payment_creation(add_payment_id)
        session = requests.Session()
        session.trust_env = False  # straight to the load balancer, whatever proxy is set
        self.session = wrapRequestsWithPayment(session, client)
        self.address = wallet.address
        self.name = name
        self.payment_id = ""
        self.count = 0

    def call(self, url: str) -> Call:
        """One paid call, retried under its payment id until it is answered."""
        self.count += 1
        self.payment_id = f"hosts-{self.name}-{self.count}-{secrets.token_hex(6)}"
        body = {"title": f"{self.name}-{self.count}-{secrets.token_hex(4)}", "csv": CSV}
        call = Call(self.address, self.payment_id, time.perf_counter())
        deadline = time.monotonic() + ANSWER_DEADLINE
        while True:
            try:
                response = self.session.post(url, json=body, timeout=CALL_TIMEOUT)
            except Exception as exc:  # a reset or a timeout: retried under the same id
                call.attempts.append(type(exc).__name__)
            else:
                call.attempts.append(_named(response))
                if response.status_code in (200, 202):
                    call.status = response.status_code
                    call.status_url = response.headers.get("Location", "")
                    call.finished = time.perf_counter()
                    return call
            if time.monotonic() > deadline:
                call.finished = time.perf_counter()
                return call
            time.sleep(1.0)


def _named(response: Any) -> str:
    """The status, and a problem's code: "409 payment_in_flight"."""
    if response.status_code in (200, 202):
        return str(response.status_code)
    try:
        code = response.json().get("code") or response.json().get("error") or ""
    except ValueError:
        code = ""
    return f"{response.status_code} {code}".strip()


def drive(url: str, agents: list[Agent], calls: int) -> tuple[list[Call], float]:
    results: list[Call] = []
    lock = threading.Lock()
    start = threading.Barrier(len(agents) + 1)

    def work(agent: Agent) -> None:
        start.wait()
        for _ in range(calls):
            call = agent.call(url)
            with lock:
                results.append(call)

    threads = [threading.Thread(target=work, args=(a,), daemon=True) for a in agents]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - began


def resolve(base: str, calls: list[Call]) -> None:
    """Poll every 202's status URL until it answers something other than 202."""
    import requests

    session = requests.Session()
    session.trust_env = False
    deadline = time.monotonic() + RESOLVE_DEADLINE
    for call in calls:
        while call.status == 202 and call.status_url and call.resolved is None:
            with contextlib.suppress(requests.RequestException):
                answer = session.get(base + call.status_url, timeout=10)
                if answer.status_code != 202:
                    call.resolved = answer.status_code
                    break
            if time.monotonic() > deadline:
                break
            time.sleep(1.0)


# --- the deployment --------------------------------------------------------------------------
@dataclass
class Deployment:
    processes: net.Processes
    env: dict[str, str]
    node: Any
    token: str
    seller: str
    wallets: list[Any]
    delay_ms: float
    used_wallets: int = 0

    def take_wallets(self, count: int) -> list[Any]:
        taken = self.wallets[self.used_wallets : self.used_wallets + count]
        self.used_wallets += count
        if len(taken) < count:
            raise RuntimeError("not enough funded wallets for the windows")
        return taken


def base_env(workdir: Path, chain: dict[str, str]) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    return {
        **keep,
        "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": "config.settings.production",
        "DATABASE_URL": f"postgres://postgres@{net.address('db')}:{net.PG_PORT}/{DATABASE}",
        "REDIS_URL": f"redis://{net.address('db')}:{net.REDIS_PORT}/0",
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(48),
        "DJANGO_ALLOWED_HOSTS": f"{net.address('lb')},{net.address('db')},127.0.0.1",
        "TOLLBOOTH_METRICS_TOKEN": secrets.token_urlsafe(16),
        "TOLLBOOTH_RECEIPT_KEY": "0x" + secrets.token_hex(32),
        "DJANGO_SECURE_SSL_REDIRECT": "False",  # plain HTTP inside the bench's network
        "TOLLBOOTH_THROTTLE_ADDRESS_RATE": "1000000/min",
        "TOLLBOOTH_THROTTLE_API_KEY_RATE": "1000000/min",
        "TOLLBOOTH_VAR_DIR": str(workdir / "var"),
        "LOG_LEVEL": os.environ.get("LOG_LEVEL", "WARNING"),
        "X402_LOCAL_MODE": "direct",
        **chain,
    }


def host_env(deployment: Deployment, host: str, **extra: str) -> dict[str, str]:
    """A host's environment: PostgreSQL and Redis through its own delay proxy on loopback
    (the one-host shape: the db host's own, without a proxy)."""
    return {
        **deployment.env,
        "DATABASE_URL": f"postgres://postgres@127.0.0.1:{net.PG_PORT}/{DATABASE}",
        "REDIS_URL": f"redis://127.0.0.1:{net.REDIS_PORT}/0",
        "TOLLBOOTH_VAR_DIR": str(deployment.processes.workdir / f"var-{host}"),
        **extra,
    }


def web_host_start(deployment: Deployment, host: str) -> None:
    processes, db = deployment.processes, net.address("db")
    links = [
        f"127.0.0.1:{net.PG_PORT}={db}:{net.PG_PORT}",
        f"127.0.0.1:{net.REDIS_PORT}={db}:{net.REDIS_PORT}",
        f"{net.address(host)}:{net.WEB_PORT}=127.0.0.1:{net.APP_PORT}",  # from the balancer
    ]
    net.delay_proxy(processes, host, links, deployment.delay_ms, f"{host}-proxy")
    env = host_env(deployment, host, GUNICORN_BIND=f"127.0.0.1:{net.APP_PORT}",
                   TOLLBOOTH_TRUSTED_PROXIES="1")  # fmt: skip
    processes.spawn(host, host, [sys.executable, "scripts/serve.py", "web"], env)


def worker_host_start(deployment: Deployment, host: str, beat: bool) -> None:
    processes, db = deployment.processes, net.address("db")
    links = [
        f"127.0.0.1:{net.PG_PORT}={db}:{net.PG_PORT}",
        f"127.0.0.1:{net.REDIS_PORT}={db}:{net.REDIS_PORT}",
    ]
    net.delay_proxy(processes, host, links, deployment.delay_ms, f"{host}-proxy")
    roles = ["worker", "beat"] if beat else ["worker"]
    env = host_env(deployment, host)
    processes.spawn(host, host, [sys.executable, "scripts/serve.py", *roles], env)


def one_host_start(deployment: Deployment) -> None:
    env = host_env(deployment, "one", GUNICORN_BIND=f"0.0.0.0:{net.APP_PORT}",
                   TOLLBOOTH_CELERY_QUEUE="one-host")  # fmt: skip
    deployment.processes.spawn("db", "one-host", [sys.executable, "scripts/serve.py", "web",
                                                  "worker"], env)  # fmt: skip


def wait_ready(url: str, timeout: float = 120.0) -> None:
    import requests

    session = requests.Session()
    session.trust_env = False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.RequestException):
            if session.get(url, timeout=3).status_code == 200:
                return
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready within {timeout:.0f} s")


def wait_workers(deployment: Deployment, names: list[str], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    for name in names:
        log = deployment.processes.log(name)
        while " ready." not in (log.read_text(errors="replace") if log.exists() else ""):
            if time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                raise RuntimeError(f"{name}: no Celery worker ready\n{tail}")
            time.sleep(0.3)


_SEED = """
from fulfillment.executors.report import REPORT_INPUT_SCHEMA
from purchases.models import Offering
Offering.objects.update_or_create(slug={slug!r}, defaults=dict(
    title="Bench report", executor="report", price={price}, asset={token!r}, network={network!r},
    pay_to={seller!r}, input_schema=REPORT_INPUT_SCHEMA))
"""


@contextlib.contextmanager
def deployment_up(workdir: Path, delay_ms: float, wallets_needed: int) -> Any:
    """The hosts, the chain, a migrated database with the offering; torn down on exit."""
    import subprocess

    from eth_account import Account

    from devtools.anvil import AnvilNode, block_time_from_env, confirmation_timeout_for
    from tests.fixtures.anvil import deploy_funded_usdc

    processes = net.Processes(workdir)
    block_time = block_time_from_env()
    try:
        net.network_create()
        net.database_host_start(processes)
        with AnvilNode(accounts=1, block_time=block_time) as node:
            port = node.rpc_url.rsplit(":", 1)[1]
            chain_url = f"http://{net.GATEWAY}:{net.CHAIN_PORT}"
            net.delay_proxy(processes, None, [f"{net.GATEWAY}:{net.CHAIN_PORT}=127.0.0.1:{port}"],
                            delay_ms, "chain-proxy")  # fmt: skip
            deployer, seller, relayer = Account.create(), Account.create(), Account.create()
            for account in (deployer, relayer):
                node.rpc("anvil_setBalance", [account.address, hex(1_000 * 10**18)])
            wallets = [Account.create() for _ in range(wallets_needed)]
            token = deploy_funded_usdc(node, deployer, [w.address for w in wallets], FUNDS)
            chain = {"X402_LOCAL_RPC_URL": chain_url, "X402_LOCAL_TOKEN": token,
                     "X402_LOCAL_RELAYER_KEY": relayer.key.hex()}  # fmt: skip
            if block_time is not None:
                chain["X402_LOCAL_CONFIRMATION_TIMEOUT"] = str(confirmation_timeout_for(block_time))
            env = base_env(workdir, chain)
            admin = f"postgres://postgres@{net.address('db')}:{net.PG_PORT}/postgres"
            import psycopg

            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{DATABASE}"')
            subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
                           cwd=ROOT, env=env, check=True)  # fmt: skip
            seed = _SEED.format(slug=SLUG, price=PRICE, token=token, network=NETWORK,
                                seller=seller.address)  # fmt: skip
            subprocess.run([sys.executable, "manage.py", "shell", "-c", seed], cwd=ROOT, env=env,
                           check=True)  # fmt: skip
            deployment = Deployment(processes, env, node, token, seller.address, wallets, delay_ms)
            for host in WEB_HOSTS:
                web_host_start(deployment, host)
            for host in WORKER_HOSTS:
                worker_host_start(deployment, host, beat=host == "worker1")
            net.load_balancer_start(processes, WEB_HOSTS)
            one_host_start(deployment)
            for host in WEB_HOSTS:
                wait_ready(f"http://{net.address(host)}:{net.WEB_PORT}/readyz")
            wait_ready(f"http://{net.address('lb')}:{net.WEB_PORT}/readyz")
            wait_ready(f"http://{net.address('db')}:{net.APP_PORT}/readyz")
            wait_workers(deployment, [*WORKER_HOSTS, "one-host"])
            yield deployment
    finally:
        processes.stop_all()
        net.network_remove()


def shape_url(shape: str) -> str:
    if shape == ONE_HOST:
        return f"http://{net.address('db')}:{net.APP_PORT}"
    return f"http://{net.address('lb')}:{net.WEB_PORT}"


# --- a window and its checks ---------------------------------------------------------------
@dataclass
class Window:
    shape: str
    calls: list[Call]
    wall: float
    fault: str = ""
    checks: dict[str, int] = field(default_factory=dict)

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
    if fault:
        time.sleep(cut_after)
        fault_start(deployment, fault)
    thread.join()
    if fault:
        fault_end(deployment, fault)
    window = Window(shape, outcome["calls"], outcome["wall"], fault)
    resolve(shape_url(HOSTS if shape == HOSTS else ONE_HOST), window.calls)
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
                    f"{c['unresolved']} unresolved; "
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


def measure(plan: Plan, delay_ms: float, workdir: Path) -> list[Window]:
    windows_count = 2 * plan.repeats + len(plan.faults)
    windows: list[Window] = []
    with deployment_up(workdir, delay_ms, AGENTS * (windows_count + 1)) as deployment:
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

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", choices=sorted(PLANS), default="full")
    parser.add_argument("--repeats", type=int, help="0: only the faults")
    parser.add_argument("--calls", type=int, help="calls per agent per window")
    parser.add_argument("--delay-ms", type=float, default=2.0, help="added each way per link")
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
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-hosts-") as tmp:
        workdir = Path(tmp)
        try:
            windows = measure(plan, args.delay_ms, workdir)
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
    print(f"\n{args.scale} run, {AGENTS} agents, {args.delay_ms:g} ms each way per link; load "
          f"average {load[0]:.2f} at start, {load[1]:.2f} at end (2 cores, shared)")  # fmt: skip
    failures = [f"{w.fault}: {', '.join(failed_checks(w))}" for w in windows
                if w.fault and failed_checks(w)]  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average": load, "delay_ms": args.delay_ms,
        "figures": [row.__dict__ for row in rows],
        "fault_checks": {w.fault: w.checks for w in windows if w.fault},
    }, indent=2) + "\n")  # fmt: skip
    for failure in failures:
        print(f"bench.hosts: FAULT CHECK FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
