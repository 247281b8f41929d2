"""The paid x402 call: Tollbooth as production serves it against the `x402` SDK's own seller
and against the chain's own ceiling (a bare broadcaster).

Every window (one side, one agent count, one repeat) runs on a fresh anvil: automine, or a
block every DEMO_CHAIN_BLOCK_TIME seconds; one test USDC (the same address on every chain),
one funded wallet per agent. Tollbooth runs as `make serve` runs it (the ASGI role that
production routes the paid URL to, config/gunicorn_asgi.py: uvicorn workers, the wait for
the block on the event loop; BENCH_X402_SERVE=wsgi: the gthread role, config/gunicorn.py;
and a Celery worker, production settings, PostgreSQL and Redis, direct settlement by its
relayer: a new relayer key per chain); the anchor is bench/sdk_seller.py
(the SDK's FastAPI middleware with its synchronous facilitator on a 32-thread pool) under
uvicorn; the bare broadcaster (`BareSender`) signs and sends transferWithAuthorization and
waits for the receipt, nothing else. Both sellers sell the same report. The agents are the
official x402 Python client exactly as docs/examples/x402_buy.py uses it, one thread and
one wallet each, every call a new input (so no call is a duplicate of another). A call
counts when the caller gets the 200 result (the broadcaster: a successful receipt).

BENCH_X402_DEMO=1 adds a side served in the demo's own shape (`make demo`, scripts/demo.py: its
router on one address sending the paid URL to one uvicorn worker and the rest to two gunicorn
workers, a Celery worker with beat on two threads, config.settings.local on its embedded
SQLite database and filesystem broker), tagged `[demo]`; BENCH_X402_SIDES=demo,sdk,bare
measures it alone against both anchors; BENCH_X402_DEMO_ASGI_WORKERS=N gives its ASGI role N
uvicorn workers instead of the demo's one; BENCH_X402_DEMO_DATABASE_URL=postgres://... puts it
on PostgreSQL instead of its SQLite file.

Figures: throughput and p50 latency ratios per agent count (ours / the SDK's, ours / the
bare broadcaster's); on automine also Tollbooth's settlements per second with the most
agents against one agent calling serially. Automine: 8 and 16 agents; on a block time: 32
(BENCH_X402_AGENTS overrides).

    DATABASE_URL=postgres://... REDIS_URL=redis://... python -m bench.x402_seller [smoke|full]
    DEMO_CHAIN_BLOCK_TIME=2 BENCH_X402_AGENTS=32,64 python -m bench.x402_seller full
    DEMO_CHAIN_BLOCK_TIME=2 BENCH_X402_AGENTS=64 BENCH_X402_REPEATS=3 BENCH_X402_DEMO=1 \
        BENCH_X402_SIDES=demo,sdk,bare python -m bench.x402_seller full

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import psycopg
import requests
from eth_account import Account
from eth_account.signers.local import LocalAccount
from x402 import x402ClientSync
from x402.http.clients.requests import wrapRequestsWithPayment
from x402.mechanisms.evm.exact import ExactEvmClientScheme

from bench.common import Figure, Scale
from bench.proc_cpu import GROUPS, cpu_per_call, cpu_reading, cpu_spent
from devtools.anvil import AnvilNode, block_time_from_env, confirmation_timeout_for
from payments.chain.token import (
    transfer_authorization_typed_data,
    transfer_with_authorization_calldata,
)

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
    serial_calls: int  # 0: no serial measurement (at block time one call takes a block)
    levels: tuple[int, ...]
    block_time: float | None = None  # None: automine (a block per transaction)


def plan_for(scale: Scale) -> Plan:
    """The scale's plan on the chain's clock; BENCH_X402_AGENTS (e.g. "32,64") sets the levels,
    BENCH_X402_REPEATS the repeats."""
    block_time = block_time_from_env()
    if scale is Scale.SMOKE:
        plan = Plan(repeats=1, calls_per_agent=1, serial_calls=2, levels=(4,))
    elif block_time is None:
        # 5 repeats of 15 calls an agent: a measurement of 40 calls at 8 agents lasted about
        # a second, too short to say how the SDK seller behaves under sustained load.
        plan = Plan(repeats=5, calls_per_agent=15, serial_calls=24, levels=(8, 16))
    else:
        plan = Plan(repeats=5, calls_per_agent=5, serial_calls=0, levels=(32,))
    if block_time is not None:
        plan = replace(plan, block_time=block_time, serial_calls=0)
    levels = os.environ.get("BENCH_X402_AGENTS", "").strip()
    if levels:
        plan = replace(plan, levels=tuple(int(n) for n in levels.split(",")))
    repeats = os.environ.get("BENCH_X402_REPEATS", "").strip()
    if repeats:
        plan = replace(plan, repeats=int(repeats))
    return plan


@dataclass(frozen=True)
class Keys:
    """The run's fixed accounts: the deployer's first transaction on every fresh chain makes
    the token at the same address, so Tollbooth's offering is seeded once per run."""

    deployer: LocalAccount
    seller: LocalAccount


@dataclass
class Chain:
    node: AnvilNode
    token: str
    seller: str
    relayer_keys: list[str]  # one per Tollbooth served: relayers never share a key
    facilitator_key: str
    agents: list[LocalAccount]
    block_time: float | None = None


# How a call ended: 200 with the result; 202 answered pending (settlement_pending or the
# work still running: the status URL in Location, as a wait that outlived the offering's
# expected run time is answered); no answer within the client's own CALL_TIMEOUT; anything
# else (another status, a refused or reset connection).
RESULT, PENDING, TIMEOUT, ERROR = "200", "202", "timeout", "error"


@dataclass(frozen=True)
class Answer:
    kind: str  # RESULT, PENDING, TIMEOUT or ERROR
    latency: float | None = None  # seconds, for RESULT and PENDING
    why: str = ""  # for TIMEOUT and ERROR


@dataclass(frozen=True)
class Load:
    """What one round of agents got: the latencies of the calls answered with their result
    (200) and of those answered pending (202), the calls that timed out and the other
    failures, wall time. Throughput and p50 count the 200s only."""

    latencies: list[float]
    failures: list[str]
    wall: float
    first_block: int = 0  # the chain's height when the window started
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds per group (proc_cpu)
    pending: list[float] = field(default_factory=list)
    timeouts: list[str] = field(default_factory=list)

    @property
    def answered(self) -> int:
        """Calls answered 200 or 202 (what the CPU per call divides by)."""
        return len(self.latencies) + len(self.pending)

    def counts(self) -> str:
        return (f"200: {len(self.latencies)}, 202 pending: {len(self.pending)}, "
                f"timeouts: {len(self.timeouts)}, errors: {len(self.failures)}")  # fmt: skip

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


def start_chain(node: AnvilNode, agents: int, keys: Keys, block_time: float | None) -> Chain:
    from tests.fixtures.anvil import deploy_funded_usdc  # dev tooling: batched mints

    for account in (keys.deployer, keys.seller):
        node.rpc("anvil_setBalance", [account.address, hex(1_000 * ETH)])
    facilitator = _funded_key(node)
    relayers = [_funded_key(node).key.hex() for _ in range(2)]
    wallets = [_funded_key(node) for _ in range(agents)]
    token = deploy_funded_usdc(node, keys.deployer, [w.address for w in wallets], FUNDS)
    return Chain(
        node, token, keys.seller.address, relayers, facilitator.key.hex(), wallets, block_time
    )


@contextlib.contextmanager
def fresh_chain(plan: Plan, agents: int, keys: Keys) -> Iterator[Chain]:
    """A new anvil for one window: every side starts on a chain of the same length (anvil
    slows down as its chain grows: a bare broadcaster fell from 605 to 102 tx/s between
    block 700 and 4,500 on one long-lived node)."""
    with AnvilNode(accounts=1, block_time=plan.block_time) as node:
        yield start_chain(node, agents, keys, plan.block_time)


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
    chain: Chain | None, database_url: str, var_dir: Path, port: int, index: int
) -> dict[str, str]:
    redis_url = os.environ.get("REDIS_URL", "")
    if not redis_url:
        raise RuntimeError("bench.x402_seller needs REDIS_URL")
    env = {
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
        "X402_LOCAL_MODE": "direct",
        # Production's shape selling on anvil: serve.py's catalog check would refuse it.
        "TOLLBOOTH_BENCH_ALLOW_LOCAL_NETWORKS": "True",
        "GUNICORN_BIND": f"127.0.0.1:{port}",
        "GUNICORN_ASGI_BIND": f"127.0.0.1:{port}",
        "GUNICORN_ACCESS_LOG": os.environ.get("BENCH_GUNICORN_ACCESS_LOG", "-"),
    }
    if chain is not None:
        env |= {
            "X402_LOCAL_RPC_URL": chain.node.rpc_url,
            "X402_LOCAL_TOKEN": chain.token,
            "X402_LOCAL_RELAYER_KEY": chain.relayer_keys[index],
        }
        if chain.block_time is not None:
            timeout = str(confirmation_timeout_for(chain.block_time))
            env.setdefault("X402_LOCAL_CONFIRMATION_TIMEOUT", timeout)
    return env


_SEED = """
from fulfillment.executors.report import REPORT_INPUT_SCHEMA
from purchases.models import Offering
Offering.objects.update_or_create(slug={slug!r}, defaults=dict(
    title="Bench report", executor="report", price={price}, asset={token!r}, network={network!r},
    pay_to={seller!r}, input_schema=REPORT_INPUT_SCHEMA))
"""


@dataclass
class TollboothSide:
    """One Tollbooth served in the run: its code, its database (kept across windows), the
    token its offering was seeded with."""

    label: str
    root: Path
    index: int
    database_url: str = ""
    token: str = ""


@contextlib.contextmanager
def tollbooth_database(side: TollboothSide, workdir: Path) -> Iterator[TollboothSide]:
    """A fresh database for the run, migrated once; every window serves it on a new chain."""
    with bench_database(side.label) as database_url:
        side.database_url = database_url
        env = tollbooth_env(None, database_url, workdir / f"var-{side.label}", 0, side.index)
        subprocess.run([PYTHON, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=side.root,
                       env=env, check=True)  # fmt: skip
        yield side


@contextlib.contextmanager
def tollbooth(chain: Chain, workdir: Path, side: TollboothSide) -> Iterator[str]:
    """`make serve ROLES="mcp worker"` (or "web worker", `_web_role`) from the side's code
    on this window's chain, with a relayer key of the window's own (the relayer's nonces
    live in the database, and a new chain starts them at 0): yields the paid URL."""
    port = _free_port()
    env = tollbooth_env(chain, side.database_url, workdir / f"var-{side.label}", port, side.index)
    if side.token != chain.token:
        seed = _SEED.format(slug=SLUG, price=PRICE, token=chain.token, network=NETWORK,
                            seller=chain.seller)  # fmt: skip
        subprocess.run([PYTHON, "manage.py", "shell", "-c", seed], cwd=side.root, env=env,
                       check=True)  # fmt: skip
        side.token = chain.token
    log = workdir / f"tollbooth-{side.label}.log"
    serve = _spawn([PYTHON, "scripts/serve.py", _web_role(), "worker"], env, log, cwd=side.root)
    try:
        _wait_http(f"http://127.0.0.1:{port}/readyz", serve, log, timeout=90)
        _wait_worker(log, serve)
        yield f"http://127.0.0.1:{port}/x402/{SLUG}"
    finally:
        _stop(serve, grace=60)


# --- the demo's own shape -------------------------------------------------------------------

DEMO = "demo"
# The demo's processes a paid call meets: not its job service nor its sample upstream.
DEMO_PROCESSES = ("router", "web", "mcp", "worker")


def _demo_script() -> Any:
    """scripts/demo.py as a module, so the bench serves the very specs `make demo` starts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_demo_script", ROOT / "scripts/demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def demo_env(chain: Chain | None, var_dir: Path) -> dict[str, str]:
    """The environment scripts/demo.py gives its processes, on its embedded defaults (no
    DATABASE_URL or REDIS_URL: SQLite and the filesystem broker in its var dir)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env |= {
        "DJANGO_SETTINGS_MODULE": "config.settings.local",
        "TOLLBOOTH_VAR_DIR": str(var_dir),
        "PYTHONUNBUFFERED": "1",
        "TOLLBOOTH_TRUSTED_PROXIES": "1",
        # Every agent calls from 127.0.0.1: the per-address throttle would count them as one.
        "TOLLBOOTH_THROTTLE_ADDRESS_RATE": "1000000/min",
        "TOLLBOOTH_THROTTLE_API_KEY_RATE": "1000000/min",
    }
    # BENCH_X402_DEMO_DATABASE_URL: the demo on that database instead of its SQLite file (as
    # `make demo` with DATABASE_URL set), to see what the embedded database costs.
    if os.environ.get("BENCH_X402_DEMO_DATABASE_URL"):
        env["DATABASE_URL"] = os.environ["BENCH_X402_DEMO_DATABASE_URL"]
    if chain is not None:
        env |= {
            "X402_LOCAL_RPC_URL": chain.node.rpc_url,
            "X402_LOCAL_TOKEN": chain.token,
            "X402_LOCAL_RELAYER_KEY": chain.relayer_keys[0],
        }
        if chain.block_time is not None:
            timeout = str(confirmation_timeout_for(chain.block_time))
            env.setdefault("X402_LOCAL_CONFIRMATION_TIMEOUT", timeout)
    return env


@contextlib.contextmanager
def demo_database(side: TollboothSide, workdir: Path) -> Iterator[TollboothSide]:
    """The demo's SQLite database in a var dir of its own, migrated once for the run."""
    var_dir = workdir / f"var-{side.label}"
    var_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run([PYTHON, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=side.root,
                   env=demo_env(None, var_dir), check=True)  # fmt: skip
    yield side


@contextlib.contextmanager
def demo_shape(chain: Chain, workdir: Path, side: TollboothSide) -> Iterator[str]:
    """scripts/demo.py's router, web, mcp and worker, as it starts them, on this window's
    chain: yields the paid URL at the router's address, as the banner prints it."""
    var_dir = workdir / f"var-{side.label}"
    env = demo_env(chain, var_dir)
    if side.token != chain.token:
        seed = _SEED.format(slug=SLUG, price=PRICE, token=chain.token, network=NETWORK,
                            seller=chain.seller)  # fmt: skip
        subprocess.run([PYTHON, "manage.py", "shell", "-c", seed], cwd=side.root, env=env,
                       check=True)  # fmt: skip
        side.token = chain.token
    port = _free_port()
    roles = {"wsgi": f"http://127.0.0.1:{_free_port()}",
             "asgi": f"http://127.0.0.1:{_free_port()}"}  # fmt: skip
    demo = _demo_script()
    specs = [spec for spec in demo.process_specs(env, roles, f"127.0.0.1:{port}")
             if spec.name in DEMO_PROCESSES]  # fmt: skip
    # BENCH_X402_DEMO_ASGI_WORKERS: the ASGI role's uvicorn workers, to see what one costs
    # (the demo runs one).
    asgi_workers = os.environ.get("BENCH_X402_DEMO_ASGI_WORKERS", "").strip()
    for spec in specs:
        if spec.name == "mcp" and asgi_workers:
            spec.env = {**spec.env, "GUNICORN_ASGI_WORKERS": asgi_workers}
    processes: dict[str, subprocess.Popen[bytes]] = {}
    logs = {spec.name: workdir / f"demo-{spec.name}.log" for spec in specs}
    try:
        for spec in specs:
            processes[spec.name] = _spawn(spec.args, spec.env, logs[spec.name], cwd=side.root)
        base = f"http://127.0.0.1:{port}"
        _wait_http(f"{base}/readyz", processes["web"], logs["web"], timeout=90)
        _wait_http(f"{roles['asgi']}/readyz", processes["mcp"], logs["mcp"], timeout=90)
        _wait_http(f"{base}/readyz", processes["router"], logs["router"], timeout=30)
        _wait_worker(logs["worker"], processes["worker"])
        yield f"{base}/x402/{SLUG}"
    finally:
        for process in processes.values():
            _stop(process, grace=60)


def _web_role() -> str:
    """BENCH_X402_SERVE: `asgi` (default) serves the paid URL as production routes it, by
    the ASGI role (`make serve ROLES=mcp`: uvicorn workers, the wait for the block on the
    event loop); `wsgi` by the WSGI role (gthread: each waiting payment holds a thread)."""
    serve = os.environ.get("BENCH_X402_SERVE", "asgi")
    if serve not in ("asgi", "wsgi"):
        raise RuntimeError(f"BENCH_X402_SERVE={serve!r}: asgi or wsgi")
    return "mcp" if serve == "asgi" else "web"


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
    """bench/sdk_seller.py under uvicorn: one process (its facilitator's nonces are counted
    per process), settling on its pool of SETTLEMENT_THREADS threads."""
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

    def call(self, url: str) -> Answer:
        """One paid call with a fresh input: its result (200), answered pending (202, with
        the status URL), timed out (the client's CALL_TIMEOUT) or failed."""
        self.calls += 1
        body = {"title": f"{self.name}-{self.calls}-{secrets.token_hex(4)}", "csv": CSV}
        started = time.perf_counter()
        try:
            response = self.session.post(url, json=body, timeout=CALL_TIMEOUT)
        except requests.Timeout as exc:
            return Answer(TIMEOUT, why=f"{type(exc).__name__}: {exc}"[:200])
        except Exception as exc:  # a failed call is counted, not fatal
            return Answer(ERROR, why=f"{type(exc).__name__}: {exc}"[:200])
        elapsed = time.perf_counter() - started
        if response.status_code == 200:
            return Answer(RESULT, elapsed)
        if response.status_code == 202 and response.headers.get("Location"):
            return Answer(PENDING, elapsed)
        return Answer(ERROR, why=f"{response.status_code}: {response.text[:200]}")


class BareSender:
    """The chain's own ceiling: no seller, no HTTP, no record. Each sender signs a
    transferWithAuthorization as its agent would, sends it from a relayer of its own (its
    nonces counted here, so senders never wait on each other) and waits for the receipt:
    read at once, then every RECEIPT_POLL seconds. A call counts when the receipt says the
    transfer landed."""

    RECEIPT_POLL = 0.05

    def __init__(self, wallet: LocalAccount, relayer: LocalAccount, chain: Chain) -> None:
        self.wallet, self.relayer, self.chain = wallet, relayer, chain
        self.session = requests.Session()
        self.nonce = 0
        self.gas_price = 0

    def _rpc(self, method: str, params: list[object]) -> object:
        body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
        reply = self.session.post(self.chain.node.rpc_url, json=body, timeout=30).json()
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result")

    def call(self, _url: str) -> Answer:
        started = time.perf_counter()
        try:
            landed = self._send_and_wait()
        except Exception as exc:  # a failed call is counted, not fatal
            return Answer(ERROR, why=f"{type(exc).__name__}: {exc}"[:200])
        if landed is None:
            return Answer(TIMEOUT, why=f"no receipt within {CALL_TIMEOUT:g} s")
        if not landed:
            return Answer(ERROR, why="reverted")
        return Answer(RESULT, time.perf_counter() - started)

    def _send_and_wait(self) -> bool | None:
        """True: landed; False: reverted; None: no receipt within CALL_TIMEOUT."""
        if not self.gas_price:  # twice the first price: the base fee only falls from there
            self.gas_price = 2 * int(str(self._rpc("eth_gasPrice", [])), 16)
        authorization = {
            "from": self.wallet.address,
            "to": self.chain.seller,
            "value": PRICE,
            "validAfter": 0,
            "validBefore": int(time.time()) + 3600,
            "nonce": "0x" + secrets.token_hex(32),
        }
        signable = transfer_authorization_typed_data(
            token_address=self.chain.token, chain_id=self.chain.node.chain_id, name="USDC",
            version="2", authorization=authorization,
        )  # fmt: skip
        signature = self.wallet.sign_message(signable).signature
        tx: dict[str, Any] = {
            "to": self.chain.token,
            "data": transfer_with_authorization_calldata(authorization, signature),
            "value": 0,
            "gas": 150_000,
            "gasPrice": self.gas_price,
            "nonce": self.nonce,
            "chainId": self.chain.node.chain_id,
        }
        raw = self.relayer.sign_transaction(tx).raw_transaction
        tx_hash = self._rpc("eth_sendRawTransaction", ["0x" + raw.hex().removeprefix("0x")])
        self.nonce += 1
        deadline = time.monotonic() + CALL_TIMEOUT
        while time.monotonic() < deadline:
            receipt = self._rpc("eth_getTransactionReceipt", [tx_hash])
            if isinstance(receipt, dict):
                return bool(receipt.get("status") == "0x1")
            time.sleep(self.RECEIPT_POLL)
        return None


class Caller(Protocol):
    def call(self, url: str) -> Answer: ...


def drive(url: str, agents: Sequence[Caller], calls_per_agent: int) -> Load:
    """Every agent calls `calls_per_agent` times back to back, all agents at once."""
    by_kind: dict[str, list[Answer]] = {RESULT: [], PENDING: [], TIMEOUT: [], ERROR: []}
    lock = threading.Lock()
    start = threading.Barrier(len(agents) + 1)

    def work(agent: Caller) -> None:
        start.wait()
        for _ in range(calls_per_agent):
            answer = agent.call(url)
            with lock:
                by_kind[answer.kind].append(answer)

    threads = [threading.Thread(target=work, args=(agent,), daemon=True) for agent in agents]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    return Load(
        latencies=[a.latency for a in by_kind[RESULT] if a.latency is not None],
        failures=[a.why for a in by_kind[ERROR]],
        wall=wall,
        pending=[a.latency for a in by_kind[PENDING] if a.latency is not None],
        timeouts=[a.why for a in by_kind[TIMEOUT]],
    )


# --- the windows --------------------------------------------------------------------------

BARE, SDK = "bare", "sdk"


@dataclass
class Rounds:
    """Loads per side ("ours", "sdk", "bare", optionally "before") and agent count, per
    repeat; the serial loads per Tollbooth side (automine only)."""

    loads: dict[str, dict[int, list[Load]]]
    serial: dict[str, list[Load]]
    block_time: float | None = None


def _before_root() -> Path | None:
    """BENCH_X402_BEFORE_ROOT: an export of an earlier commit, served side by side."""
    value = os.environ.get("BENCH_X402_BEFORE_ROOT", "")
    return Path(value).resolve() if value else None


@contextlib.contextmanager
def _serving(side: str, chain: Chain, workdir: Path, tollbooths: dict[str, TollboothSide]
             ) -> Iterator[str]:  # fmt: skip
    if side == BARE:
        yield ""
    elif side == SDK:
        with sdk_seller(chain, workdir) as url:
            yield url
    elif side == DEMO:
        with demo_shape(chain, workdir, tollbooths[side]) as url:
            yield url
    else:
        with tollbooth(chain, workdir, tollbooths[side]) as url:
            yield url


def _callers(side: str, chain: Chain, count: int) -> list[Caller]:
    wallets = chain.agents[:count]
    if side == BARE:
        return [BareSender(w, _funded_key(chain.node), chain) for w in wallets]
    return [Agent(w, chain.token, f"agent{i}") for i, w in enumerate(wallets)]


def window(
    side: str, plan: Plan, level: int, keys: Keys, workdir: Path,
    tollbooths: dict[str, TollboothSide], serial: bool = False,
) -> tuple[Load, Load | None]:  # fmt: skip
    """One measurement on a fresh chain: the side served, warmed up (two calls), then
    `level` agents calling at once; before them, one agent calling serially if asked."""
    with fresh_chain(plan, level, keys) as chain, _serving(side, chain, workdir, tollbooths) as url:
        callers = _callers(side, chain, level)
        drive(url, callers[:2], 1)  # warm-up: connections, imports, first queries
        serial_load = drive(url, callers[:1], plan.serial_calls) if serial else None
        first_block = int(str(chain.node.rpc("eth_blockNumber")), 16)
        cpu_before = cpu_reading()
        load = drive(url, callers, plan.calls_per_agent)
        cpu = cpu_spent(cpu_before, cpu_reading())
        return replace(load, first_block=first_block, cpu=cpu), serial_load


def measure(plan: Plan, workdir: Path) -> Rounds:
    keys = Keys(deployer=Account.create(), seller=Account.create())
    before = _before_root()
    specs = [TollboothSide("ours", ROOT, 0)]
    if before is not None:
        specs.append(TollboothSide("before", before, 1))
    # BENCH_X402_SIDES (e.g. "ours,bare"): only those sides, as a long slow-clock run asks.
    chosen = {x.strip() for x in os.environ.get("BENCH_X402_SIDES", "").split(",")} - {""}
    if os.environ.get("BENCH_X402_DEMO", "").strip() in ("1", "true", "yes"):
        specs.append(TollboothSide(DEMO, ROOT, len(specs)))
    specs = [s for s in specs if not chosen or s.label in chosen]  # no database unused
    with contextlib.ExitStack() as stack:
        tollbooths = {
            s.label: stack.enter_context(
                demo_database(s, workdir) if s.label == DEMO else tollbooth_database(s, workdir)
            )
            for s in specs
        }
        every_side = [*tollbooths, SDK, BARE]
        rounds = Rounds({side: {n: [] for n in plan.levels} for side in every_side}, {},
                        plan.block_time)  # fmt: skip
        sides = [side for side in every_side if not chosen or side in chosen]
        most = max(plan.levels)
        for repeat in range(plan.repeats):
            for level in plan.levels:
                # The order rotates every repeat, so a noisy neighbour hits all sides alike.
                shift = repeat % len(sides)
                for side in sides[shift:] + sides[:shift]:
                    serial = bool(plan.serial_calls) and level == most and side in tollbooths
                    load, serial_load = window(side, plan, level, keys, workdir, tollbooths,
                                               serial)  # fmt: skip
                    rounds.loads[side][level].append(load)
                    if serial_load is not None:
                        rounds.serial.setdefault(side, []).append(serial_load)
                    print(f"bench.x402_seller: repeat {repeat + 1}, {level} agents, {side}: "
                          f"{_fmt([load])} ({load.counts()}), from block {load.first_block}, "
                          f"load average {os.getloadavg()[0]:.1f}; "
                          f"{cpu_per_call(load.cpu, load.answered)}",
                          file=sys.stderr)  # fmt: skip
    return rounds


# --- the figures --------------------------------------------------------------------------


def _fmt(loads: list[Load]) -> str:
    rates = "/".join(f"{load.throughput:.2f}" for load in loads)
    p50s = "/".join(f"{load.p50:.3f}" for load in loads)
    failed = sum(len(load.failures) for load in loads)
    pending = sum(len(load.pending) for load in loads)
    timeouts = sum(len(load.timeouts) for load in loads)
    return (f"{rates} calls/s, p50 {p50s} s" + (f", {pending} answered 202" if pending else "")
            + (f", {timeouts} timed out" if timeouts else "")
            + (f", {failed} failed" if failed else ""))  # fmt: skip


def _cpu_median(loads: list[Load]) -> str:
    """Per group, the median over the repeats of its CPU per call (bench/proc_cpu.py)."""
    per_call = [{g: sec / load.answered for g, sec in load.cpu.items()}
                for load in loads if load.answered and load.cpu]  # fmt: skip
    if not per_call:
        return "no reading"
    medians = {g: statistics.median(c.get(g, 0.0) for c in per_call) for g in GROUPS}
    return cpu_per_call(medians, 1)


def _ratio(ours: float, anchor: float) -> float:
    return ours / anchor if anchor else 0.0


def figures(rounds: Rounds) -> list[Figure]:
    out: list[Figure] = []
    for name in [n for n in rounds.loads if n not in (SDK, BARE)]:
        out += _figures_of(name, rounds)
    return out


def _clock(rounds: Rounds) -> str:
    return "automine" if rounds.block_time is None else f"{rounds.block_time:g} s blocks"


def _figures_of(name: str, rounds: Rounds) -> list[Figure]:
    tag = "" if name == "ours" else f" [{name}]"
    on_clock = rounds.block_time is not None
    clock = f", {_clock(rounds)}" if on_clock else ""
    out: list[Figure] = []
    for level, ours in rounds.loads[name].items():
        if not ours:
            continue  # a side left out (BENCH_X402_SIDES)
        out.append(Figure(
            f"x402 paid call{tag}: calls answered (200, or 202 with a status URL), {level} agents"
            f"{clock}",
            [load.answered / max(1, load.answered + len(load.timeouts) + len(load.failures))
             for load in ours],
            goal=">= 1.0", detail=f"{'; '.join(load.counts() for load in ours)}",
        ))  # fmt: skip
        sdk, bare = rounds.loads[SDK][level], rounds.loads[BARE][level]
        blocks = "/".join(str(load.first_block) for load in ours + sdk + bare)
        detail = (f"tollbooth{tag} {_fmt(ours)}; sdk {_fmt(sdk)}; bare broadcaster "
                  f"{_fmt(bare)}; windows from blocks {blocks}")  # fmt: skip
        failed = [why for load in ours + sdk + bare for why in load.timeouts + load.failures]
        failures = failed[:3]
        extra = {"failures": " | ".join(failures)} if failures else {}
        extra["cpu"] = "; ".join(f"{side} {_cpu_median(loads)}" for side, loads in
                                 (("tollbooth", ours), ("sdk", sdk), ("bare", bare)))  # fmt: skip
        # Issue 22's goals at block time; the automine goals are the earlier ones.
        vs_sdk = (">= 1.5", "<= 0.8") if on_clock else (">= 2.0", "<= 0.5")
        if sdk:
            out.append(Figure(
                f"x402 paid call{tag}: throughput vs x402 SDK seller, {level} agents{clock}",
                [_ratio(a.throughput, b.throughput) for a, b in zip(ours, sdk, strict=True)],
                goal=vs_sdk[0], detail=detail, extra=extra,
            ))  # fmt: skip
            out.append(Figure(
                f"x402 paid call{tag}: p50 latency vs x402 SDK seller, {level} agents{clock}",
                [a.p50 / b.p50 for a, b in zip(ours, sdk, strict=True)],
                goal=vs_sdk[1], detail=detail, extra=extra,
            ))  # fmt: skip
        if bare:
            out.append(Figure(
                f"x402 paid call{tag}: throughput vs bare broadcaster, {level} agents{clock}",
                [_ratio(a.throughput, b.throughput) for a, b in zip(ours, bare, strict=True)],
                goal=(">= 0.9" if level <= 32 else ">= 0.7") if on_clock else "",
                detail=detail, extra=extra,
            ))  # fmt: skip
            # The goal is p50 <= the broadcaster's + 300 ms: as a ratio, at the broadcaster's
            # median p50.
            bare_p50 = statistics.median(load.p50 for load in bare)
            p50_goal = f"<= {(bare_p50 + 0.3) / bare_p50:.2f}" if on_clock else ""
            out.append(Figure(
                f"x402 paid call{tag}: p50 latency vs bare broadcaster, {level} agents{clock}",
                [a.p50 / b.p50 for a, b in zip(ours, bare, strict=True)],
                goal=p50_goal, extra=extra,
                detail=detail + "; goal: the broadcaster's p50 + 300 ms",
            ))  # fmt: skip
    if rounds.serial.get(name):
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
            return figures(measure(plan_for(scale), workdir))
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
