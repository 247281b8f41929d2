"""The paid x402 call: Tollbooth as production serves it against the `x402` SDK's own seller.

One anvil (automine), one test USDC, one funded wallet per agent. Tollbooth runs as `make
serve` runs it (gunicorn per config/gunicorn.py and a Celery worker, production settings,
PostgreSQL and Redis, direct settlement by its relayer); the anchor is bench/sdk_seller.py
(the SDK's FastAPI middleware with an in-process facilitator) under uvicorn, settling on the
same anvil. Both sell the same report. The agents are the official x402 Python client exactly
as docs/examples/x402_buy.py uses it, one thread and one wallet each, every call a new input
(so no call is a duplicate of another). A call counts when the caller gets the 200 result.

Figures: throughput and p50 latency ratios at 8 and 16 agents (ours / the SDK's), and
Tollbooth's settlements per second with 16 agents against one agent calling serially.

    DATABASE_URL=postgres://... REDIS_URL=redis://... python -m bench.x402_seller [smoke|full]

It creates (and drops) a database of its own beside DATABASE_URL's.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import requests
from eth_account import Account
from eth_account.signers.local import LocalAccount
from x402 import x402ClientSync
from x402.http.clients.requests import wrapRequestsWithPayment
from x402.mechanisms.evm.exact import ExactEvmClientScheme

from bench.common import Figure, Scale
from devtools.anvil import AnvilNode

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
NETWORK = "eip155:31337"
PRICE = 10_000  # 0.01 test USDC
FUNDS = 1_000 * 10**6
ETH = 10**18
SLUG = "bench-report"
CSV = "region,units,price\nnorth,3,1.50\nsouth,5,2.25\neast,8,0.75\nwest,1,9.99\n"
CALL_TIMEOUT = 60.0

# One generated receipt key for every replica of a run (they sign for one seller).
RECEIPT_KEY = "0x" + secrets.token_hex(32)


@dataclass(frozen=True)
class Plan:
    repeats: int
    calls_per_agent: int
    serial_calls: int
    levels: tuple[int, ...] = (8, 16)


PLANS = {
    Scale.SMOKE: Plan(repeats=1, calls_per_agent=1, serial_calls=2),
    # 5 repeats of 15 calls an agent: the SDK seller is bimodal (docs/benchmarks.md), and a
    # measurement of 40 calls at 8 agents lasted about a second, too short to say how often.
    Scale.FULL: Plan(repeats=5, calls_per_agent=15, serial_calls=24),
}


@dataclass
class Chain:
    node: AnvilNode
    token: str
    seller: str
    relayer_keys: list[str]  # one per Tollbooth served: relayers never share a key
    facilitator_key: str
    agents: list[LocalAccount]


@dataclass(frozen=True)
class Load:
    """What one round of agents got: successful call latencies, failures, wall time."""

    latencies: list[float]
    failures: list[str]
    wall: float

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.wall if self.wall else 0.0

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies) if self.latencies else float("inf")


# --- the chain ----------------------------------------------------------------------------


def _funded_key(node: AnvilNode) -> LocalAccount:
    account: LocalAccount = Account.create()
    node.rpc("anvil_setBalance", [account.address, hex(1_000 * ETH)])
    return account


def start_chain(node: AnvilNode, agents: int) -> Chain:
    from tests.fixtures.anvil import deploy_funded_usdc  # dev tooling: batched mints

    deployer, seller, facilitator = (_funded_key(node) for _ in range(3))
    relayers = [_funded_key(node).key.hex() for _ in range(2)]
    wallets = [_funded_key(node) for _ in range(agents)]
    token = deploy_funded_usdc(node, deployer, [w.address for w in wallets], FUNDS)
    return Chain(node, token, seller.address, relayers, facilitator.key.hex(), wallets)


# --- processes ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_http(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited:\n{log.read_text(errors='replace')[-4000:]}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready:\n{log.read_text(errors='replace')[-4000:]}")


def _stop(process: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def _spawn(
    args: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT
) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


@contextlib.contextmanager
def bench_database(label: str) -> Iterator[str]:
    """A fresh database beside DATABASE_URL's, dropped afterwards."""
    base = os.environ.get("DATABASE_URL", "")
    if not base.startswith("postgres"):
        raise RuntimeError("bench.x402_seller needs DATABASE_URL=postgres://... (and REDIS_URL)")
    parts = urlsplit(base)
    name = f"{parts.path.lstrip('/')}_bench_x402_{label}"
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(parts._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def tollbooth_env(
    chain: Chain, database_url: str, var_dir: Path, port: int, index: int
) -> dict[str, str]:
    redis_url = os.environ.get("REDIS_URL", "")
    if not redis_url:
        raise RuntimeError("bench.x402_seller needs REDIS_URL")
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings.production",
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "TOLLBOOTH_CELERY_QUEUE": f"bench-x402-{os.getpid()}-{index}",
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(48),
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1",
        "TOLLBOOTH_METRICS_TOKEN": secrets.token_urlsafe(16),
        "TOLLBOOTH_RECEIPT_KEY": RECEIPT_KEY,
        "DJANGO_SECURE_SSL_REDIRECT": "False",  # plain HTTP on loopback
        # Every agent calls from 127.0.0.1: the per-address throttle would count them as one.
        "TOLLBOOTH_THROTTLE_ADDRESS_RATE": "1000000/min",
        "TOLLBOOTH_THROTTLE_API_KEY_RATE": "1000000/min",
        "TOLLBOOTH_VAR_DIR": str(var_dir),
        "X402_LOCAL_RPC_URL": chain.node.rpc_url,
        "X402_LOCAL_TOKEN": chain.token,
        "X402_LOCAL_RELAYER_KEY": chain.relayer_keys[index],
        "X402_LOCAL_MODE": "direct",
        "GUNICORN_BIND": f"127.0.0.1:{port}",
        "GUNICORN_ACCESS_LOG": os.environ.get("BENCH_GUNICORN_ACCESS_LOG", "-"),
    }


_SEED = """
from fulfillment.executors.report import REPORT_INPUT_SCHEMA
from purchases.models import Offering
Offering.objects.update_or_create(slug={slug!r}, defaults=dict(
    title="Bench report", executor="report", price={price}, asset={token!r}, network={network!r},
    pay_to={seller!r}, input_schema=REPORT_INPUT_SCHEMA))
"""


@contextlib.contextmanager
def tollbooth(chain: Chain, workdir: Path, *, root: Path = ROOT, index: int = 0) -> Iterator[str]:
    """`make serve ROLES="web worker"` from `root` on a fresh database: yields the paid URL."""
    port = _free_port()
    label = "before" if root != ROOT else "ours"
    with bench_database(label) as database_url:
        env = tollbooth_env(chain, database_url, workdir / f"var-{label}", port, index)
        manage = [PYTHON, "manage.py"]
        subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], cwd=root, env=env,
                       check=True)  # fmt: skip
        seed = _SEED.format(slug=SLUG, price=PRICE, token=chain.token, network=NETWORK,
                            seller=chain.seller)  # fmt: skip
        subprocess.run([*manage, "shell", "-c", seed], cwd=root, env=env, check=True)
        log = workdir / f"tollbooth-{label}.log"
        serve = _spawn([PYTHON, "scripts/serve.py", "web", "worker"], env, log, cwd=root)
        try:
            _wait_http(f"http://127.0.0.1:{port}/readyz", serve, log, timeout=90)
            _wait_worker(log, serve)
            yield f"http://127.0.0.1:{port}/x402/{SLUG}"
        finally:
            _stop(serve, grace=60)


def _wait_worker(log: Path, process: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if " ready." in log.read_text(errors="replace"):
            return
        if process.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"celery worker not ready:\n{log.read_text(errors='replace')[-4000:]}")


@contextlib.contextmanager
def sdk_seller(chain: Chain, workdir: Path) -> Iterator[str]:
    """bench/sdk_seller.py under uvicorn (one process, as the SDK's examples run it)."""
    port = _free_port()
    env = {
        **os.environ,
        "RPC_URL": chain.node.rpc_url,
        "TOKEN": chain.token,
        "PAY_TO": chain.seller,
        "PRICE": str(PRICE),
        "FACILITATOR_KEY": chain.facilitator_key,
    }
    log = workdir / "sdk-seller.log"
    args = [PYTHON, "-m", "uvicorn", "bench.sdk_seller:app", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", "--backlog", "2048"]  # fmt: skip
    process = _spawn(args, env, log)
    try:
        _wait_http(f"http://127.0.0.1:{port}/docs", process, log, timeout=60)
        yield f"http://127.0.0.1:{port}/report"
    finally:
        _stop(process)


# --- the agents ---------------------------------------------------------------------------


class Agent:
    """One paying agent: its own wallet and the stock client, as docs/examples/x402_buy.py."""

    def __init__(self, wallet: LocalAccount, token: str, name: str) -> None:
        client = x402ClientSync()
        # As the example does: the SDK takes an eth_account account (its protocol is narrower).
        client.register(NETWORK, ExactEvmClientScheme(signer=wallet))  # type: ignore[arg-type]
        client.set_spend_controls({"allowed_assets": [{"network": NETWORK, "asset": token}]})
        self.session = wrapRequestsWithPayment(requests.Session(), client)
        self.name = name
        self.calls = 0

    def call(self, url: str) -> tuple[float | None, str]:
        """One paid call with a fresh input: (latency, "") on a 200 result, else (None, why)."""
        self.calls += 1
        body = {"title": f"{self.name}-{self.calls}-{secrets.token_hex(4)}", "csv": CSV}
        started = time.perf_counter()
        try:
            response = self.session.post(url, json=body, timeout=CALL_TIMEOUT)
        except Exception as exc:  # a failed call is counted, not fatal
            return None, f"{type(exc).__name__}: {exc}"[:200]
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            return None, f"{response.status_code}: {response.text[:200]}"
        return elapsed, ""


def drive(url: str, agents: list[Agent], calls_per_agent: int) -> Load:
    """Every agent calls `calls_per_agent` times back to back, all agents at once."""
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(len(agents) + 1)

    def work(agent: Agent) -> None:
        start.wait()
        for _ in range(calls_per_agent):
            latency, why = agent.call(url)
            with lock:
                if latency is None:
                    failures.append(why)
                else:
                    latencies.append(latency)

    threads = [threading.Thread(target=work, args=(agent,), daemon=True) for agent in agents]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return Load(latencies, failures, time.perf_counter() - began)


# --- the figures --------------------------------------------------------------------------


@dataclass
class Rounds:
    """Loads per server ("ours", "sdk", optionally "before") and agent count, per repeat."""

    loads: dict[str, dict[int, list[Load]]]
    serial: dict[str, list[Load]]


def _before_root() -> Path | None:
    """BENCH_X402_BEFORE_ROOT: an export of an earlier commit, served side by side."""
    value = os.environ.get("BENCH_X402_BEFORE_ROOT", "")
    return Path(value).resolve() if value else None


def measure(plan: Plan, workdir: Path) -> Rounds:
    most = max(plan.levels)
    before = _before_root()
    with contextlib.ExitStack() as stack, AnvilNode(accounts=1) as node:
        chain = start_chain(node, most)
        agents = [Agent(w, chain.token, f"agent{i}") for i, w in enumerate(chain.agents)]
        urls = {"ours": stack.enter_context(tollbooth(chain, workdir))}
        if before is not None:
            urls["before"] = stack.enter_context(tollbooth(chain, workdir, root=before, index=1))
        urls["sdk"] = stack.enter_context(sdk_seller(chain, workdir))
        rounds = Rounds({name: {n: [] for n in plan.levels} for name in urls}, {})
        for url in urls.values():  # warm-up: connections, imports, first queries
            drive(url, agents[:2], 1)
        for _ in range(plan.repeats):  # interleaved, so a noisy neighbour hits all alike
            for name, url in urls.items():
                if name != "sdk":
                    load = drive(url, agents[:1], plan.serial_calls)
                    rounds.serial.setdefault(name, []).append(load)
            for level in plan.levels:
                for name, url in urls.items():
                    load = drive(url, agents[:level], plan.calls_per_agent)
                    rounds.loads[name][level].append(load)
    return rounds


def _fmt(loads: list[Load]) -> str:
    rates = "/".join(f"{load.throughput:.2f}" for load in loads)
    p50s = "/".join(f"{load.p50:.3f}" for load in loads)
    failed = sum(len(load.failures) for load in loads)
    return f"{rates} calls/s, p50 {p50s} s" + (f", {failed} failed" if failed else "")


def _ratio(ours: float, anchor: float) -> float:
    return ours / anchor if anchor else 0.0


def figures(rounds: Rounds) -> list[Figure]:
    out: list[Figure] = []
    for name in [n for n in rounds.loads if n != "sdk"]:
        out += _figures_of(name, rounds)
    return out


def _figures_of(name: str, rounds: Rounds) -> list[Figure]:
    tag = "" if name == "ours" else f" [{name}]"
    out: list[Figure] = []
    for level, ours in rounds.loads[name].items():
        theirs = rounds.loads["sdk"][level]
        detail = f"tollbooth{tag} {_fmt(ours)}; sdk {_fmt(theirs)}"
        failures = [why for load in ours + theirs for why in load.failures][:3]
        extra = {"failures": " | ".join(failures)} if failures else {}
        out.append(Figure(
            f"x402 paid call{tag}: throughput vs x402 SDK seller, {level} agents",
            [_ratio(a.throughput, b.throughput) for a, b in zip(ours, theirs, strict=True)],
            goal=">= 2.0", detail=detail, extra=extra,
        ))  # fmt: skip
        out.append(Figure(
            f"x402 paid call{tag}: p50 latency vs x402 SDK seller, {level} agents",
            [a.p50 / b.p50 for a, b in zip(ours, theirs, strict=True)],
            goal="<= 0.5", detail=detail, extra=extra,
        ))  # fmt: skip
    most = max(rounds.loads[name])
    parallel, serial = rounds.loads[name][most], rounds.serial[name]
    out.append(Figure(
        f"x402 settlements{tag}: {most} agents vs serial",
        [_ratio(a.throughput, b.throughput) for a, b in zip(parallel, serial, strict=True)],
        goal=">= 4.0",
        detail=f"{most} agents {_fmt(parallel)}; serial {_fmt(serial)}",
    ))  # fmt: skip
    return out


def run(scale: Scale) -> list[Figure]:
    with tempfile.TemporaryDirectory(prefix="bench-x402-") as tmp:
        workdir = Path(tmp)
        try:
            return figures(measure(PLANS[scale], workdir))
        except Exception:
            for log in sorted(workdir.glob("*.log")):
                tail = log.read_text(errors="replace")[-3000:]
                print(f"--- {log.name} (tail) ---\n{tail}", file=sys.stderr)
            raise


def main(argv: list[str]) -> int:
    scale = Scale(argv[0]) if argv else Scale.SMOKE
    for figure in run(scale):
        verdict = {True: "ok", False: "MISSED", None: ""}[figure.meets_goal()]
        print(
            f"{figure.name}: median {figure.median:.2f} (min {figure.minimum:.2f}, "
            f"max {figure.maximum:.2f}) goal {figure.goal} {verdict}\n    {figure.detail}"
        )
        for key, value in figure.extra.items():
            print(f"    {key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
