"""`make demo`: migrate, seed, then run the API + admin, a Celery worker with beat and the
external job service, all on embedded defaults. Ctrl-C stops every process it started.

With DATABASE_URL / REDIS_URL set it uses PostgreSQL and Redis instead of SQLite and the
filesystem broker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
HOST = os.environ.get("DEMO_HOST", "127.0.0.1")
PORT = int(os.environ.get("DEMO_PORT", "8000"))
JOB_PORT = int(os.environ.get("DEMO_JOB_SERVICE_PORT", "8765"))
VAR = Path(os.environ.get("TOLLBOOTH_VAR_DIR", ROOT / "var"))


def manage(*args: str, capture: bool = False) -> str:
    result = subprocess.run(
        [PYTHON, "manage.py", *args], cwd=ROOT, check=True, text=True, capture_output=capture
    )
    return result.stdout if capture else ""


def spawn(name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    log = (VAR / "logs" / f"{name}.log").open("ab")
    # Own process group, so stopping it also stops whatever it forked (celery pool, beat).
    return subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def stop_all(processes: dict[str, subprocess.Popen[bytes]]) -> None:
    for process in processes.values():
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    for name, process in processes.items():
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"  {name} did not stop in time; killing it")
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def banner(seed: dict, base: str) -> None:
    print("\n=== Tollbooth demo is running ===")
    print(
        f"  Agent API      {base}/api/v1/   (OpenAPI: {base}/api/schema/, docs: {base}/api/docs/)"
    )
    print(f"  Admin          {base}/admin/")
    print(f"  Job service    http://127.0.0.1:{JOB_PORT}")
    print("  Staff logins:")
    for staff in seed["staff"]:
        print(f"    {staff['username']:<8} / {staff['password']}")
    print("  Agents (Authorization: Bearer <key>):")
    for agent in seed["agents"]:
        print(f"    {agent['name']:<18} {agent['api_key']}")
    print(f"  Credentials are saved in {seed['credentials_file']}; logs in {VAR / 'logs'}/")
    print(f"  Try it:  {PYTHON} scripts/demo_agent.py {base}")
    print("  Ctrl-C stops everything.\n", flush=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the demo as cleanly as Ctrl-C


def main() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")
    (VAR / "logs").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "JOB_SERVICE_URL": f"http://127.0.0.1:{JOB_PORT}", "PYTHONUNBUFFERED": "1"}
    print("Migrating the database ...", flush=True)
    manage("migrate", "--noinput", "-v", "0")
    seed = json.loads(manage("seed_demo", capture=True))
    processes = {
        "jobservice": spawn(
            "jobservice",
            [
                PYTHON,
                "-m",
                "jobservice.server",
                "--port",
                str(JOB_PORT),
                "--db",
                str(VAR / "jobservice.sqlite3"),
            ],
            env,
        ),
        "worker": spawn(
            "worker",
            [
                PYTHON,
                "-m",
                "celery",
                "-A",
                "config",
                "worker",
                "--beat",
                "--pool",
                "threads",
                "--concurrency",
                "2",
                "--loglevel",
                "INFO",
            ],
            env,
        ),
        "web": spawn(
            "web", [PYTHON, "manage.py", "runserver", f"{HOST}:{PORT}", "--noreload"], env
        ),
    }
    signal.signal(signal.SIGTERM, _interrupt)
    banner(seed, f"http://{HOST}:{PORT}")
    try:
        while True:
            for name, process in processes.items():
                if process.poll() is not None:
                    print(f"{name} exited with {process.returncode}; see {VAR / 'logs' / name}.log")
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nStopping ...", flush=True)
        return 0
    finally:
        stop_all(processes)
        print("Stopped.", flush=True)


if __name__ == "__main__":
    sys.exit(main())
