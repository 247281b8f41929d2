"""`make serve`: run Tollbooth as production does, on PostgreSQL and Redis.

    make serve                      # one host: migrate, then web + mcp + worker + beat
    make serve ROLES=web            # a web replica (N of them behind a load balancer)
    make serve ROLES=mcp            # an MCP replica: the ASGI app for /mcp (docs/mcp.md)
    make serve ROLES=worker         # a Celery worker (M of them)
    make serve ROLES="worker beat"  # the one host that also runs beat
    make serve ROLES=migrate        # the release step, once per deploy, before the rest

Refuses, listing everything missing, unless DATABASE_URL, REDIS_URL, DJANGO_SECRET_KEY,
DJANGO_ALLOWED_HOSTS and TOLLBOOTH_METRICS_TOKEN are set; then the production settings judge
their values and `check --deploy --database default` the catalog (an active offering on a
local chain is refused: purchases/checks.py). Each role is a separate process with its output
on this terminal (the container runtime's log). When one of them exits, the others are
stopped and this exits non-zero so a supervisor restarts the set. Ctrl-C or SIGTERM stops
them gracefully: gunicorn lets in-flight requests finish, Celery finishes its running tasks
(acks_late: a task cut off is delivered again). See docs/deployment.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BIN = Path(PYTHON).parent
REQUIRED = {
    "DATABASE_URL": "PostgreSQL, e.g. postgres://tollbooth:...@db:5432/tollbooth",
    "REDIS_URL": "Redis for the Celery broker and throttle counters, e.g. redis://redis:6379/0",
    "DJANGO_SECRET_KEY": "a random value of at least 50 characters",
    "DJANGO_ALLOWED_HOSTS": "the host names agents and staff use, comma-separated",
    "TOLLBOOTH_METRICS_TOKEN": "the bearer token Prometheus sends to /metrics",
}
ROLES = ("migrate", "web", "mcp", "worker", "beat")
STOP_WAIT_SECONDS = 150  # gunicorn's graceful timeout (the longest paid wait) and a margin


def missing_settings(env: dict[str, str]) -> list[str]:
    return [f"  {name}: {meaning}" for name, meaning in REQUIRED.items() if not env.get(name)]


def settings_error(env: dict[str, str]) -> str | None:
    """The production settings' own verdict on the values (weak key, wildcard hosts, ...)."""
    result = subprocess.run(
        [
            PYTHON,
            "manage.py",
            "check",
            "--deploy",
            "--database",
            "default",
            "--fail-level",
            "ERROR",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode == 0:
        return None
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    if "ERRORS:" in lines:  # a failed system check: its errors, not its closing count
        errors = lines[lines.index("ERRORS:") + 1 :]
        return "\n".join(line for line in errors if not line.startswith("System check"))
    return lines[-1] if lines else f"manage.py check exited with {result.returncode}"


def commands(roles: list[str]) -> dict[str, list[str]]:
    celery = [str(BIN / "celery"), "-A", "config"]
    concurrency = os.environ.get("CELERY_CONCURRENCY", "2")
    table = {
        "web": [str(BIN / "gunicorn"), "-c", "python:config.gunicorn"],
        # Uvicorn workers under gunicorn: MCP's long-lived connections (config/gunicorn_asgi.py).
        "mcp": [str(BIN / "gunicorn"), "-c", "python:config.gunicorn_asgi"],
        "worker": [
            *celery,
            "worker",
            "--concurrency",
            concurrency,
            "--max-tasks-per-child",
            "1000",
            "--hostname",
            "worker-%i@%h",
            "--loglevel",
            "INFO",
        ],
        "beat": [*celery, "beat", "--loglevel", "INFO"],
    }
    return {role: table[role] for role in roles if role in table}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def stop_all(processes: dict[str, subprocess.Popen[bytes]]) -> None:
    for process in processes.values():
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_SECONDS
    for name, process in processes.items():
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"serve: {name} did not stop in time; killing it", flush=True)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run(roles: list[str], env: dict[str, str]) -> int:
    if "migrate" in roles:
        subprocess.run([PYTHON, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env, check=True)
    # WhiteNoise serves what this collects into STATIC_ROOT (var/static).
    if "web" in roles or "mcp" in roles:
        subprocess.run(
            [PYTHON, "manage.py", "collectstatic", "--noinput", "-v", "0"],
            cwd=ROOT,
            env=env,
            check=True,
        )
    to_start = commands(roles)
    if not to_start:
        return 0
    processes = {
        role: subprocess.Popen(args, cwd=ROOT, env=env, start_new_session=True)
        for role, args in to_start.items()
    }
    signal.signal(signal.SIGTERM, _interrupt)
    print(f"serve: running {', '.join(processes)}; Ctrl-C stops them.", flush=True)
    try:
        while True:
            for role, process in processes.items():
                if process.poll() is not None:
                    print(f"serve: {role} exited with {process.returncode}", flush=True)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("serve: stopping ...", flush=True)
        return 0
    finally:
        stop_all(processes)


def main(argv: list[str]) -> int:
    roles = [role for arg in argv for role in arg.replace(",", " ").split()] or list(ROLES)
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        print(f"serve: unknown role(s) {unknown}; choose from {list(ROLES)}", file=sys.stderr)
        return 2
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings.production"}
    missing = missing_settings(env)
    if missing:
        print("serve: refusing to start; set these first:", *missing, sep="\n", file=sys.stderr)
        print("See docs/deployment.md.", file=sys.stderr)
        return 2
    error = settings_error(env)
    if error:
        print(f"serve: refusing to start: {error}", file=sys.stderr)
        return 2
    return run(roles, env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
