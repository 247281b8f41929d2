"""The hosts of `make bench-hosts` (bench/hosts.py): network namespaces on one machine.

Each host is a namespace with one veth on a bridge in the root namespace (10.231.0.0/24,
the root namespace at .1, where the chain and the load client run). Every link between
hosts goes through a delay proxy (bench/delay_proxy.c; bench/delay_proxy.py where there is
no C compiler) run inside the host that opens it (the web and worker hosts' connections to
PostgreSQL and Redis), or inside the host that accepts it
(the load balancer's connections to a web host); the chain's RPC goes through one in the
root namespace. Taking a host's veth down therefore cuts every link it has.

Needs root (ip netns), iproute2, Debian's PostgreSQL server binaries
(/usr/lib/postgresql/*/bin), redis-server and haproxy.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from devtools.demo_router import haproxy_acls

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "tbh"  # namespaces tbh-<host>, host-side veths tbh-<host>, the bridge tbh0
BRIDGE = f"{PREFIX}0"
SUBNET = "10.231.0"
GATEWAY = f"{SUBNET}.1"
ADDRESSES = {"lb": 10, "web1": 11, "web2": 12, "worker1": 21, "worker2": 22, "db": 30}
PG_PORT, REDIS_PORT, WEB_PORT, APP_PORT, CHAIN_PORT = 5432, 6379, 8000, 8001, 8545
# A web host's ASGI role (the paid URL, /mcp) beside its WSGI role: reached from the balancer
# on ASGI_WEB_PORT, served on ASGI_APP_PORT behind the host's delay proxy.
ASGI_WEB_PORT, ASGI_APP_PORT = WEB_PORT + 2, APP_PORT + 2
HAPROXY = "/usr/sbin/haproxy"


def address(host: str) -> str:
    return f"{SUBNET}.{ADDRESSES[host]}"


def netns(host: str) -> str:
    return f"{PREFIX}-{host}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def missing_requirements() -> list[str]:
    """What this machine lacks to run the hosts, each with how to get it."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root: network namespaces need it (CI runs as root)")
    if not shutil.which("ip"):
        missing.append("iproute2: apt-get install iproute2")
    if not pg_bin_dir():
        missing.append("PostgreSQL's server binaries: apt-get install postgresql")
    if not shutil.which("redis-server"):
        missing.append("redis-server: apt-get install redis-server")
    if not Path(HAPROXY).exists():
        missing.append("haproxy: apt-get install haproxy (make bench-hosts installs it)")
    return missing


def pg_bin_dir() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: p.parts[-3])
    return found[-1].parent if found else None


# --- the network -----------------------------------------------------------------------------
def network_remove() -> None:
    """Every namespace and link of ours, with whatever still runs in them (also a dead
    run's leftovers)."""
    for host in ADDRESSES:
        name = netns(host)
        pids = _ip("netns", "pids", name, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", name, check=False)
        _ip("link", "del", name, check=False)
    _ip("link", "del", BRIDGE, check=False)
    # A deleted namespace's veth goes away a moment later: wait, or the next run's
    # `ip link add` finds the name taken.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        names = [netns(host) for host in ADDRESSES] + [BRIDGE]
        if all(_ip("link", "show", n, check=False).returncode != 0 for n in names):
            return
        time.sleep(0.2)


def network_create() -> None:
    network_remove()
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{GATEWAY}/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    for host, last in ADDRESSES.items():
        name = netns(host)
        _ip("netns", "add", name)
        _ip("link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("link", "set", name, "master", BRIDGE, "up")
        _ip("-n", name, "addr", "add", f"{SUBNET}.{last}/24", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        _ip("-n", name, "link", "set", "lo", "up")


def link_set(host: str, up: bool) -> None:
    """Cut a host off the network (its veth down), or bring it back."""
    _ip("link", "set", netns(host), "up" if up else "down")
    if up:  # a veth taken down leaves the bridge's port disabled until it is up again
        _ip("link", "set", netns(host), "master", BRIDGE)


# --- processes -------------------------------------------------------------------------------
@dataclass
class Processes:
    """Everything started for the run, by host; stopped by process group."""

    workdir: Path
    started: dict[str, list[tuple[str, subprocess.Popen[bytes]]]] = field(default_factory=dict)

    def spawn(
        self, host: str | None, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """`args` inside the host's namespace (None: the root namespace); output to a log."""
        command = ["ip", "netns", "exec", netns(host), *args] if host else args
        log = self.log(name)
        with log.open("ab") as out:
            process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.started.setdefault(host or "root", []).append((name, process))
        return process

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def stop_host(self, host: str, hard: bool = False) -> None:
        """SIGTERM (SIGKILL when hard) to every process group started on the host."""
        for _, process in self.started.pop(host, []):
            _signal_group(process, signal.SIGKILL if hard else signal.SIGTERM)

    def stop_all(self) -> None:
        everything = [p for group in self.started.values() for _, p in group]
        for process in everything:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for process in everything:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
        self.started.clear()


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def delay_proxy(
    processes: Processes, host: str | None, links: list[str], delay_ms: float, name: str
) -> None:
    """A delay proxy (bench/delay_proxy.py: the C build where there is a compiler) in the
    host, waiting until it listens."""
    from bench.delay_proxy import command

    args = command(delay_ms, links, native=os.environ.get("BENCH_HOSTS_PROXY", "c") != "python")
    process = processes.spawn(host, name, args, {**os.environ, "PYTHONPATH": str(ROOT)})
    wait_for_log(processes.log(name), "delay proxy ready", process, 30)


def wait_for_log(log: Path, text: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text(errors="replace"):
            return
        if process.poll() is not None:
            break
        time.sleep(0.1)
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    raise RuntimeError(f"{log.name}: no {text!r} within {timeout:.0f} s\n{tail}")


# --- the database host: a private PostgreSQL and Redis -----------------------------------------
def database_host_start(processes: Processes) -> None:
    """initdb on a temporary directory, then PostgreSQL and Redis in the db namespace."""
    bin_dir = pg_bin_dir()
    assert bin_dir is not None
    data = processes.workdir / "pgdata"
    sockets = processes.workdir / "pgsocket"
    for path in (data, sockets):
        path.mkdir()
        shutil.chown(path, "postgres", "postgres")
    processes.workdir.chmod(0o755)  # postgres must reach its directories
    subprocess.run(
        ["runuser", "-u", "postgres", "--", str(bin_dir / "initdb"), "-D", str(data),
         "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
        check=True, capture_output=True,
    )  # fmt: skip
    (data / "pg_hba.conf").write_text(
        f"local all all trust\nhost all all 127.0.0.1/32 trust\nhost all all {SUBNET}.0/24 trust\n"
    )
    settings = {
        "listen_addresses": f"127.0.0.1,{address('db')}",
        "port": str(PG_PORT),
        "unix_socket_directories": str(sockets),
        "max_connections": "400",
        # A peer cut off the network holds its transaction's row locks until the server
        # notices it is gone: keepalives notice within about 11 s (see docs/deployment.md).
        "tcp_keepalives_idle": "5",
        "tcp_keepalives_interval": "2",
        "tcp_keepalives_count": "3",
        # Keepalives only judge a quiet connection. A backend that answered a statement to
        # the cut peer has data no one acknowledges, and TCP retransmits it for a quarter
        # of an hour while the backend holds its transaction's locks: give up after 10 s.
        "tcp_user_timeout": "10000",
        # A backend busy in a statement (a lock wait) reads no socket: look every 5 s.
        "client_connection_check_interval": "5000",
    }
    args = ["runuser", "-u", "postgres", "--", str(bin_dir / "postgres"), "-D", str(data)]
    for key, value in settings.items():
        args += ["-c", f"{key}={value}"]
    postgres = processes.spawn("db", "postgres", args)
    wait_for_log(processes.log("postgres"), "ready to accept connections", postgres, 60)
    redis = processes.spawn(
        "db", "redis",
        ["redis-server", "--bind", f"127.0.0.1 {address('db')}", "--port", str(REDIS_PORT),
         "--save", "", "--appendonly", "no", "--protected-mode", "no", "--tcp-keepalive", "5",
         "--dir", str(processes.workdir)],
    )  # fmt: skip
    wait_for_log(processes.log("redis"), "Ready to accept connections", redis, 30)


# --- the load balancer -------------------------------------------------------------------------
HAPROXY_CONFIG = """global
    maxconn 4096
defaults
    mode http
    option forwardfor
    timeout connect 2s
    timeout client 150s
    # Above gunicorn's timeout: never cut a paid request still inside its wait.
    timeout server 150s
    retries 2
    option redispatch
frontend api
    bind {lb}:{port}
    # The paid URL (not the status URLs under /x402/purchases/) and MCP to the ASGI role,
    # where a payment waiting for its block costs a coroutine, not a thread
    # (docs/deployment.md, The ASGI role); the rest to the WSGI role.
    # (The rule is devtools/demo_router.py's, which `make demo`'s one address follows too.)
{acls}
    default_backend web
# Out of rotation on /readyz (docs/deployment.md, Health checks); a server marked down
# has its open sessions shut, so agents retry on the other at once. The probe waits in
# gunicorn's queue like any request: with a 1 s read timeout a replica whose threads
# all wait on the chain looked dead, was taken out with its 30 sessions, and the other
# then too (a cascade seen in this bench); a host cut off fails its connect in 1 s.
backend web
    balance leastconn
    option httpchk GET /readyz
    http-check expect status 200
    timeout check 10s
    default-server inter 1s fall 3 rise 2 on-marked-down shutdown-sessions
{servers}
backend asgi
    balance leastconn
    option httpchk GET /readyz
    http-check expect status 200
    timeout check 10s
    default-server inter 1s fall 3 rise 2 on-marked-down shutdown-sessions
{asgi_servers}
"""


def load_balancer_start(processes: Processes, webs: list[str]) -> None:
    servers = "\n".join(f"    server {w} {address(w)}:{WEB_PORT} check" for w in webs)
    asgi = "\n".join(f"    server {w}-asgi {address(w)}:{ASGI_WEB_PORT} check" for w in webs)
    config = processes.workdir / "haproxy.cfg"
    config.write_text(HAPROXY_CONFIG.format(lb=address("lb"), port=WEB_PORT, servers=servers,
                                            acls=haproxy_acls(), asgi_servers=asgi))  # fmt: skip
    check = subprocess.run([HAPROXY, "-c", "-f", str(config)], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"haproxy config: {check.stdout}{check.stderr}")
    processes.spawn("lb", "haproxy", [HAPROXY, "-db", "-f", str(config)])
