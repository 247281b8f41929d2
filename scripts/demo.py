"""`make demo`: migrate, start a local anvil chain with the test USDC, seed, then run the
API + admin (the WSGI role: gunicorn, as production does), the ASGI role (uvicorn workers
under gunicorn: the x402 paid URLs and the MCP door), a Celery worker with beat, the external
job service and a sample seller upstream (devtools/sample_upstream.py: a signed HTTP endpoint
that counts its effects, sold as the `counted-echo` offering), all on embedded defaults, behind
one address (DEMO_HOST:DEMO_PORT) routed by path as production's load balancer routes it
(devtools/demo_router.py). Ctrl-C stops every process it started.

A process that dies is announced in one line and restarted (devtools/supervisor.py), unless
DEMO_RESTART=never. On the running demo, from another terminal:
    demo.py status | kill NAME | stop NAME | start NAME
    (NAME: router, web, mcp, worker, jobservice, upstream)
`kill` crashes it (SIGKILL) to rehearse a restart; `stop` keeps it down until `start`.

The chain's RPC URL, the token, the funded buyer wallets (keys generated for this run)
and every paid URL are printed and written to var/demo-chain.json, so any x402 client
can try it at once. With X402_FACILITATOR_URL set, settlement goes through it.

With DATABASE_URL / REDIS_URL set it uses PostgreSQL and Redis instead of SQLite and the
filesystem broker.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
HOST = os.environ.get("DEMO_HOST", "127.0.0.1")
PORT = int(os.environ.get("DEMO_PORT", "8000"))
JOB_PORT = int(os.environ.get("DEMO_JOB_SERVICE_PORT", "8765"))
# 0: any free port (printed in the banner and written to demo-chain.json).
CHAIN_PORT = int(os.environ.get("DEMO_CHAIN_PORT", "0"))
# The two roles behind the router: the ASGI role (paid URLs, MCP) and the WSGI role (the
# rest); 0: any free port. Reachable directly too, as a replica is behind a balancer.
MCP_PORT = int(os.environ.get("DEMO_MCP_PORT", "8001"))
WEB_PORT = int(os.environ.get("DEMO_WEB_PORT", "0"))
UPSTREAM_PORT = int(os.environ.get("DEMO_UPSTREAM_PORT", "8766"))
# Seconds between blocks (a real chain's clock: Base 2, Ethereum 12); unset: automine.
CHAIN_BLOCK_TIME_VAR = "DEMO_CHAIN_BLOCK_TIME"
VAR = Path(os.environ.get("TOLLBOOTH_VAR_DIR", ROOT / "var"))
CHAIN_FILE = VAR / "demo-chain.json"
NETWORK = "eip155:31337"
BUYER_FUNDS = 100 * 10**6  # 100 test USDC per demo wallet
REFUND_FUNDS = 1_000 * 10**6  # the refund wallet's test USDC: finance pays buyers back from it
# On a chain mining a block per transaction, an empty block this often, so payments and
# paybacks reach their finality depth (3 blocks) without anyone mining by hand.
HEARTBEAT_SECONDS = 2.0
DEMO_ALERTS_TO = "Demo support:support@demo.invalid"
sys.path.insert(0, str(ROOT))

from devtools.sample_upstream import DEMO_OFFERING as UPSTREAM_OFFERING  # noqa: E402
from devtools.sample_upstream import DEMO_SECRET_ENV as UPSTREAM_SECRET_ENV  # noqa: E402
from devtools.supervisor import (  # noqa: E402 -- needs ROOT on the path
    ProcessSpec,
    Supervisor,
    control_main,
    restart_policy_from_env,
)


def manage(*args: str, capture: bool = False) -> str:
    result = subprocess.run(
        [PYTHON, "manage.py", *args], cwd=ROOT, check=True, text=True, capture_output=capture
    )
    return result.stdout if capture else ""


def start_chain() -> tuple[Any, dict[str, Any]]:
    """A fresh anvil with the test USDC deployed, Permit2 and the upto proxy placed, and two
    funded buyer wallets that have approved Permit2."""
    from devtools.anvil import AnvilNode, block_time_from_env
    from devtools.permit2 import approve_permit2_for, place_upto_contracts
    from devtools.test_token import deploy_test_usdc, mint

    node = AnvilNode(port=CHAIN_PORT, block_time=block_time_from_env(CHAIN_BLOCK_TIME_VAR))
    w3 = node.w3()
    deployer, relayer, seller, alice, bob, refunds = node.accounts[:6]
    token = deploy_test_usdc(w3, deployer)
    for wallet in (alice, bob):
        mint(w3, token, deployer, wallet.address, BUYER_FUNDS)
    mint(w3, token, deployer, refunds.address, REFUND_FUNDS)
    # `upto` (usage pricing) settles through Permit2: placed on the chain, and each buyer's
    # one-time approval of it done here, as a buyer does once before its first upto payment.
    upto = place_upto_contracts(node)
    approve_permit2_for(w3, token, [alice, bob])
    chain = {
        "rpc_url": node.rpc_url,
        "chain_id": node.chain_id,
        "block_time": block_time_from_env(CHAIN_BLOCK_TIME_VAR),
        "network": NETWORK,
        "token": token,
        "token_domain": {"name": "USDC", "version": "2"},
        "permit2": upto["permit2"],
        "upto_proxy": upto["upto_proxy"],
        "seller": seller.address,
        "relayer_key": "0x" + relayer.key.hex(),
        "refund_wallet": {"address": refunds.address, "usdc": REFUND_FUNDS},
        "refund_wallet_key": "0x" + refunds.key.hex(),
        "facilitator_url": os.environ.get("X402_FACILITATOR_URL", ""),
        "buyers": [
            {
                "agent": name,
                "address": a.address,
                "private_key": "0x" + a.key.hex(),
                "usdc": BUYER_FUNDS,
            }
            for name, a in (("demo-agent-alice", alice), ("demo-agent-bob", bob))
        ],
    }
    return node, chain


def banner(seed: dict, chain: dict, base: str) -> None:
    print("\n=== Tollbooth demo is running ===")
    print(
        f"  Agent API      {base}/api/v1/   (OpenAPI: {base}/api/schema/, docs: {base}/api/docs/)"
    )
    print(f"  Admin          {base}/admin/")
    print(f"  Health         {base}/healthz (liveness), {base}/readyz (readiness)")
    print(f"  Job service    http://127.0.0.1:{JOB_PORT}")
    print("  Staff logins:")
    for staff in seed["staff"]:
        print(f"    {staff['username']:<8} / {staff['password']}")
    print("  Agents (Authorization: Bearer <key>):")
    for agent in seed["agents"]:
        print(f"    {agent['name']:<18} {agent['api_key']}")
    print(f"  Local chain    {chain['rpc_url']}  ({chain['network']}), test USDC {chain['token']}")
    clock = chain["block_time"]
    print(
        f"                 a block every {clock:g} s ({CHAIN_BLOCK_TIME_VAR})"
        if clock
        else f"                 a block per transaction and an empty one every "
        f"{HEARTBEAT_SECONDS:g} s ({CHAIN_BLOCK_TIME_VAR}=2: Base's clock)"
    )
    refunds = chain["refund_wallet"]
    print(
        f"  Refund wallet  {refunds['address']} ({refunds['usdc'] // 10**6} test USDC): "
        "finance's paybacks"
    )
    settle = (
        f"facilitator {chain['facilitator_url']}"
        if chain["facilitator_url"]
        else "direct (our relayer)"
    )
    print(f"  Settlement     {settle}")
    print("  Funded buyer wallets (100 test USDC each; keys made for this run only):")
    for buyer in chain["buyers"]:
        print(f"    {buyer['address']}  key {buyer['private_key']}")
    print("  Paid x402 URLs (POST the offering's input as JSON):")
    for url in chain["paid_urls"].values():
        print(f"    {url}")
    print(f"  MCP tools      {chain['mcp_url']} (Streamable HTTP), /mcp/sse (SSE):")
    print("                 pay over x402 (_meta) or send an agent's key as Authorization")
    upstream = chain["upstream"]
    print(f"  Upstream       offering {upstream['offering']!r} runs on the sample upstream")
    print(f"                 {upstream['url']} (signed); its effect count:")
    print(f"                 {upstream['stats_url']}")
    print(f"  Chain details for any x402 client: {CHAIN_FILE}")
    print(f"  Credentials are saved in {seed['credentials_file']}; logs in {VAR / 'logs'}/")
    # The agent finds the demo's files where this run put them.
    agent = f"{PYTHON} scripts/demo_agent.py"
    if VAR.resolve() != (ROOT / "var").resolve():
        agent = f"TOLLBOOTH_VAR_DIR={VAR} {agent}"
    print(f"  Try it:  {agent} {base}          (prepaid)")
    print(f"           {agent} --x402 {base}   (x402 on the local chain)")
    print(f"           {agent} --mcp   (the x402 MCP client, MCP tool")
    print(f"                 {upstream['offering']!r} on the sample upstream)")
    print(f"  Alerts         mail to DJANGO_ADMINS, printed in {VAR / 'logs'}/worker.log (console")
    print("                 mail backend), plus 'tollbooth.alerts' log lines there and in web.log;")
    print("                 TOLLBOOTH_ALERT_WEBHOOK_URL adds a webhook")
    restart = "restarted" if restart_policy_from_env() else "left down (DEMO_RESTART=never)"
    roles = chain["roles"]
    print(f"  Routing        {base} as production's balancer: the paid URLs and /mcp to the ASGI")
    print(f"                 role ({roles['asgi']}), the rest to the WSGI role ({roles['wsgi']})")
    print("  Processes      router, web, mcp, worker, jobservice, upstream: one that dies is")
    print(f"                 {restart}")
    print(f"                 {PYTHON} scripts/demo.py status | kill NAME | stop NAME | start NAME")
    print(f"  Situations     {PYTHON} manage.py demo_situation --list  (rehearse a failure)")
    print("  Ctrl-C stops everything.\n", flush=True)


def wait_ready(base: str, asgi: str, timeout: float = 60.0) -> None:
    """Print the URLs once they answer: gunicorn takes a moment to boot its workers. Both
    roles: the router's /readyz reaches the WSGI role, the paid URLs need the ASGI one."""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    for url in (f"{base}/readyz", f"{asgi}/readyz"):
        while time.monotonic() < deadline:
            try:
                with opener.open(url, timeout=5) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the demo as cleanly as Ctrl-C


def main() -> int:
    from devtools.anvil import confirmation_timeout_for

    # Named, not defaulted: wsgi.py and celery_app.py default to production.
    os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings.local"
    (VAR / "logs").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "JOB_SERVICE_URL": f"http://127.0.0.1:{JOB_PORT}", "PYTHONUNBUFFERED": "1"}
    # The sample upstream's signing secret: made for this run, known to the processes that
    # sign (web, mcp, worker) and to the upstream that checks; never written to disk.
    env[UPSTREAM_SECRET_ENV] = secrets.token_hex(32)
    upstream_url = f"http://127.0.0.1:{UPSTREAM_PORT}"
    # Alerts need a person to reach: the demo's mail backend is the console, so refund-owed
    # and escalation alerts print to var/logs/worker.log (set DJANGO_ADMINS to change who).
    env.setdefault("DJANGO_ADMINS", DEMO_ALERTS_TO)
    # Receipts and redelivery links name the address the banner prints (DEMO_HOST/DEMO_PORT).
    env.setdefault("TOLLBOOTH_PUBLIC_URL", f"http://{HOST}:{PORT}")
    # Every process counts into one directory, emptied per run: /metrics sums them all
    # (docs/deployment.md, PROMETHEUS_MULTIPROC_DIR).
    counters = VAR / "metrics"
    shutil.rmtree(counters, ignore_errors=True)
    counters.mkdir(parents=True)
    env["PROMETHEUS_MULTIPROC_DIR"] = str(counters)
    # Behind the router, as behind a balancer: the client is the last X-Forwarded-For entry.
    env.setdefault("TOLLBOOTH_TRUSTED_PROXIES", "1")
    print("Migrating the database ...", flush=True)
    manage("migrate", "--noinput", "-v", "0")
    print("Starting the local chain and deploying the test USDC ...", flush=True)
    node, chain = start_chain()
    env.update(
        {
            "X402_LOCAL_RPC_URL": chain["rpc_url"],
            "X402_LOCAL_TOKEN": chain["token"],
            "X402_LOCAL_RELAYER_KEY": chain["relayer_key"],
            "X402_LOCAL_REFUND_WALLET_KEY": chain.pop("refund_wallet_key"),
        }
    )
    if chain["block_time"]:  # a paid request waits for its block: as long as a testnet's
        env.setdefault(
            "X402_LOCAL_CONFIRMATION_TIMEOUT", str(confirmation_timeout_for(chain["block_time"]))
        )
    wallets = {buyer["agent"]: buyer["address"] for buyer in chain["buyers"]}
    seed = json.loads(
        manage(
            "seed_demo",
            "--asset",
            chain["token"],
            "--network",
            NETWORK,
            "--pay-to",
            chain["seller"],
            "--wallets",
            json.dumps(wallets),
            "--upstream-url",
            f"{upstream_url}/work",
            capture=True,
        )
    )
    base = f"http://{HOST}:{PORT}"
    chain["base_url"] = base
    chain["job_service_url"] = env["JOB_SERVICE_URL"]
    chain["paid_urls"] = {slug: f"{base}/x402/{slug}" for slug in seed["offerings"]}
    # The MCP door at the one address too: the router sends /mcp to the ASGI role.
    chain["mcp_url"] = f"{base}/mcp"
    roles = demo_roles()
    chain["roles"] = roles
    chain["upstream"] = {
        "offering": UPSTREAM_OFFERING,
        "url": f"{upstream_url}/work",
        "stats_url": f"{upstream_url}/stats",
    }
    CHAIN_FILE.write_text(json.dumps(chain, indent=2))
    CHAIN_FILE.chmod(0o600)
    supervisor = Supervisor(
        process_specs(env, roles), var_dir=VAR, restart=restart_policy_from_env(), say=print_now
    )
    signal.signal(signal.SIGTERM, _interrupt)
    supervisor.start_all()
    if not chain["block_time"]:
        _heartbeat_blocks(node)
    try:
        wait_ready(base, roles["asgi"])
        banner(seed, chain, base)
        supervisor.run(should_stop=lambda: False)
    except KeyboardInterrupt:
        print("\nStopping ...", flush=True)
    finally:
        supervisor.stop_all()
        node.stop()
        print("Stopped.", flush=True)
    return 0


def _heartbeat_blocks(node: Any) -> None:
    """An empty block every HEARTBEAT_SECONDS, on a thread that ends with the demo."""
    import threading

    def mine() -> None:
        while True:
            time.sleep(HEARTBEAT_SECONDS)
            try:
                node.mine()
            except Exception:  # the chain is stopping with the demo
                return

    threading.Thread(target=mine, name="demo heartbeat blocks", daemon=True).start()


def print_now(line: str) -> None:
    print(line, flush=True)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def demo_roles() -> dict[str, str]:
    """The base URLs of the roles behind the router, on loopback as replicas behind a
    balancer: the WSGI role on DEMO_WEB_PORT (0: a free port, kept across its restarts)."""
    return {
        "wsgi": f"http://127.0.0.1:{WEB_PORT or _free_port()}",
        "asgi": f"http://127.0.0.1:{MCP_PORT}",
    }


def process_specs(
    env: dict[str, str], roles: dict[str, str], listen: str = f"{HOST}:{PORT}"
) -> list[ProcessSpec]:
    """The six long-running processes of the demo, each restarted if it dies; the router on
    `listen` (bench/x402_seller.py serves the same specs on a port of its own)."""
    job_service = [PYTHON, "-m", "jobservice.server", "--port", str(JOB_PORT),
                   "--db", str(VAR / "jobservice.sqlite3")]  # fmt: skip
    worker = [PYTHON, "-m", "celery", "-A", "config", "worker", "--beat", "--pool", "threads",
              "--concurrency", "2", "--loglevel", "INFO"]  # fmt: skip
    # The production server (config/gunicorn.py), on the demo's settings, behind the router.
    web_env = {**env, "GUNICORN_BIND": roles["wsgi"].removeprefix("http://"),
               "GUNICORN_WORKERS": "2"}  # fmt: skip
    # The ASGI role as production serves it: uvicorn workers under gunicorn (docs/mcp.md);
    # the paid URLs and the MCP door reach it through the router.
    mcp_env = {**env, "GUNICORN_ASGI_BIND": roles["asgi"].removeprefix("http://"),
               "GUNICORN_ASGI_WORKERS": "1"}  # fmt: skip
    # Production's balancer, in one process: the one address the banner prints.
    router = [PYTHON, "-m", "devtools.demo_router", "--listen", listen,
              "--wsgi", roles["wsgi"], "--asgi", roles["asgi"]]  # fmt: skip
    mcp = [PYTHON, "-m", "gunicorn", "-c", "python:config.gunicorn_asgi"]
    # The seller's own operation: its effects are rows in its own file, kept across restarts.
    upstream = [PYTHON, "-m", "devtools.sample_upstream", "--port", str(UPSTREAM_PORT),
                "--db", str(VAR / "sample-upstream.sqlite3"),
                "--secret-env", UPSTREAM_SECRET_ENV]  # fmt: skip
    return [
        ProcessSpec("router", router, env, ROOT),
        ProcessSpec("jobservice", job_service, env, ROOT),
        ProcessSpec("upstream", upstream, env, ROOT),
        ProcessSpec("worker", worker, env, ROOT),
        ProcessSpec(
            "web", [PYTHON, "-m", "gunicorn", "-c", "python:config.gunicorn"], web_env, ROOT
        ),
        ProcessSpec("mcp", mcp, mcp_env, ROOT),
    ]


if __name__ == "__main__":
    if len(sys.argv) > 1:  # status | stop NAME | start NAME | kill NAME, on the running demo
        sys.exit(control_main(VAR, sys.argv[1:]))
    sys.exit(main())
