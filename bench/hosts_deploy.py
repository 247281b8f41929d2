"""The deployment of `make bench-hosts` (bench/hosts.py): the chain, a migrated database with
the offering, and every host's processes (`scripts/serve.py` roles) behind their delay proxies.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import hosts_net as net
from bench.hosts_agents import NETWORK, SLUG

ROOT = net.ROOT
PRICE = 10_000
FUNDS = 100 * 10**6
DATABASE = "tollbooth"
WEB_HOSTS, WORKER_HOSTS = ["web1", "web2"], ["worker1", "worker2"]
ONE_HOST, HOSTS = "one host", "across hosts"


@dataclass
class Deployment:
    processes: net.Processes
    env: dict[str, str]
    node: Any
    token: str
    seller: str
    wallets: list[Any]
    delay_ms: float
    one_host_workers: int = 0  # 0: gunicorn's default (the CPU count)
    web_host_workers: int = 0  # each web host's ASGI workers; 0: the CPU count
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
        # Production's shape selling on anvil: serve.py's catalog check would refuse it.
        "TOLLBOOTH_BENCH_ALLOW_LOCAL_NETWORKS": "True",
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
        f"{net.address(host)}:{net.ASGI_WEB_PORT}=127.0.0.1:{net.ASGI_APP_PORT}",
    ]
    net.delay_proxy(processes, host, links, deployment.delay_ms, f"{host}-proxy")
    # Both roles, as docs/deployment.md routes them: the paid URL and /mcp to the ASGI role.
    env = host_env(deployment, host, GUNICORN_BIND=f"127.0.0.1:{net.APP_PORT}",
                   GUNICORN_ASGI_BIND=f"127.0.0.1:{net.ASGI_APP_PORT}",
                   TOLLBOOTH_TRUSTED_PROXIES="1")  # fmt: skip
    if deployment.web_host_workers:  # hosts sharing the machine's cores: a share of them each
        env["GUNICORN_ASGI_WORKERS"] = str(deployment.web_host_workers)
    processes.spawn(host, host, [sys.executable, "scripts/serve.py", "web", "mcp"], env)


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
    # One port: the ASGI role alone serves the whole site, the paid URL on its event loop,
    # as the web hosts' balancer routes it.
    env = host_env(deployment, "one", GUNICORN_ASGI_BIND=f"0.0.0.0:{net.APP_PORT}",
                   TOLLBOOTH_CELERY_QUEUE="one-host")  # fmt: skip
    if deployment.one_host_workers:  # as many ASGI workers as both web hosts have
        env["GUNICORN_ASGI_WORKERS"] = str(deployment.one_host_workers)
    deployment.processes.spawn("db", "one-host", [sys.executable, "scripts/serve.py", "mcp",
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
def deployment_up(
    workdir: Path,
    delay_ms: float,
    wallets_needed: int,
    one_host_workers: int = 0,
    web_host_workers: int = 0,
) -> Iterator[Deployment]:
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
            deployment = Deployment(processes, env, node, token, seller.address, wallets,
                                    delay_ms, one_host_workers, web_host_workers)  # fmt: skip
            for host in WEB_HOSTS:
                web_host_start(deployment, host)
            for host in WORKER_HOSTS:
                worker_host_start(deployment, host, beat=host == "worker1")
            net.load_balancer_start(processes, WEB_HOSTS)
            one_host_start(deployment)
            for host in WEB_HOSTS:
                wait_ready(f"http://{net.address(host)}:{net.WEB_PORT}/readyz")
                wait_ready(f"http://{net.address(host)}:{net.ASGI_WEB_PORT}/readyz")
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
