"""Keep the demo's processes running, so support can rehearse one of them dying.

`make demo` (scripts/demo.py) runs the web server, the Celery worker and the job service
under a `Supervisor`. When one exits, it says so in one line and starts it again (after a
short backoff when it keeps dying), unless restarts are off (`DEMO_RESTART=never`) or that
process was taken down on purpose.

Control is a small directory under the demo's var dir, so any other process (the
`demo.py stop|start|kill NAME` commands, `manage.py demo_situation`, a test) can drive it:

- `<control>/processes.json`: name -> pid and state, rewritten by the supervisor;
- `<control>/<name>.down`: present = keep that process down (stopped now if running);
  removed = start it again.

`kill` is a SIGKILL to the process group, as an OOM killer or a crash would do: the
supervisor notices and restarts it like any other death.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

CONTROL_DIR = "demo-control"
STATE_FILE = "processes.json"
# A process that dies again within this long after a start is restarted after a backoff
# that doubles up to MAX_BACKOFF, so a crash loop does not spin the machine.
STABLE_AFTER_SECONDS = 10.0
MAX_BACKOFF_SECONDS = 30.0


@dataclass
class ProcessSpec:
    name: str
    args: list[str]
    env: dict[str, str]
    cwd: Path


@dataclass
class _Child:
    spec: ProcessSpec
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float | None = None
    backoff: float = 0.5  # the first restart waits 1 s (doubled on a fast death)
    restarts: int = 0
    down_on_request: bool = False
    log: IO[bytes] | None = field(default=None, repr=False)


def control_dir(var_dir: Path) -> Path:
    return Path(var_dir) / CONTROL_DIR


def restart_policy_from_env(environ: dict[str, str] | None = None) -> bool:
    """DEMO_RESTART=never leaves a dead process down; anything else (default) restarts."""
    value = (environ if environ is not None else os.environ).get("DEMO_RESTART", "always")
    return value.strip().lower() not in {"never", "no", "off", "0", "false"}


class Supervisor:
    """Start the specs, watch them, restart or leave down, obey the control directory."""

    def __init__(
        self,
        specs: list[ProcessSpec],
        *,
        var_dir: Path,
        restart: bool = True,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.children = {spec.name: _Child(spec) for spec in specs}
        self.var_dir = Path(var_dir)
        self.logs_dir = self.var_dir / "logs"
        self.control = control_dir(self.var_dir)
        self.restart = restart
        self.say = say or (lambda line: print(line, flush=True))

    # --- lifecycle -----------------------------------------------------------------------
    def start_all(self) -> None:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.control.mkdir(parents=True, exist_ok=True)
        for stale in self.control.glob("*.down"):
            stale.unlink()  # a previous run's "keep down" must not hold this run's processes
        for child in self.children.values():
            self._start(child)
        self._write_state()

    def stop_all(self, timeout: float = 15.0) -> None:
        for child in self.children.values():
            self._signal(child, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in self.children.values():
            self._reap(child, max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(FileNotFoundError):
            (self.control / STATE_FILE).unlink()

    def watch_once(self, now: float | None = None) -> None:
        """One pass: obey stop/start requests, notice deaths, restart what is due."""
        now = time.monotonic() if now is None else now
        for name, child in self.children.items():
            wants_down = (self.control / f"{name}.down").exists()
            running = child.process is not None and child.process.poll() is None
            if wants_down and not child.down_on_request:
                child.down_on_request = True
                child.restart_at = None
                if running:
                    self._signal(child, signal.SIGTERM)
                    self._reap(child, 15.0)
                self.say(f"[demo] {name} stopped on request; `demo.py start {name}` brings it back")
            elif not wants_down and child.down_on_request:
                child.down_on_request = False
                self._start(child)
                self.say(f"[demo] {name} started again on request (pid {self._pid(child)})")
            elif running or child.down_on_request:
                continue
            elif child.restart_at is None:
                self._on_death(child, now)
            elif now >= child.restart_at:
                child.restart_at = None
                child.restarts += 1
                self._start(child)
                self.say(f"[demo] {name} restarted (pid {self._pid(child)})")
        self._write_state()

    def run(self, should_stop: Callable[[], bool], interval: float = 0.3) -> None:
        while not should_stop():
            self.watch_once()
            time.sleep(interval)

    # --- helpers ---------------------------------------------------------------------------
    def _on_death(self, child: _Child, now: float) -> None:
        name = child.spec.name
        code = child.process.returncode if child.process is not None else None
        log = self.logs_dir / f"{name}.log"
        if not self.restart:
            # As if asked to stop: it stays down, and `demo.py start NAME` brings it back.
            (self.control / f"{name}.down").touch()
            child.down_on_request = True
            self.say(f"[demo] {name} exited with {code}; left down (DEMO_RESTART=never); see {log}")
            return
        crashed_fast = now - child.started_at < STABLE_AFTER_SECONDS
        child.backoff = min(child.backoff * 2, MAX_BACKOFF_SECONDS) if crashed_fast else 1.0
        child.restart_at = now + child.backoff
        self.say(f"[demo] {name} exited with {code}; restarting in {child.backoff:.0f}s; see {log}")

    def _start(self, child: _Child) -> None:
        if child.log is not None:
            child.log.close()
        child.log = (self.logs_dir / f"{child.spec.name}.log").open("ab")
        # Own process group, so stopping it also stops whatever it forked (celery pool, beat).
        child.process = subprocess.Popen(  # noqa: S603 -- our own fixed commands
            child.spec.args,
            cwd=child.spec.cwd,
            env=child.spec.env,
            stdout=child.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        child.started_at = time.monotonic()

    def _signal(self, child: _Child, sig: signal.Signals) -> None:
        if child.process is not None and child.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.process.pid, sig)

    def _reap(self, child: _Child, timeout: float) -> None:
        if child.process is None:
            return
        try:
            child.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.say(f"[demo] {child.spec.name} did not stop in time; killing it")
            self._signal(child, signal.SIGKILL)
            child.process.wait()

    @staticmethod
    def _pid(child: _Child) -> int | None:
        return child.process.pid if child.process is not None else None

    def _write_state(self) -> None:
        state = {}
        for name, child in self.children.items():
            running = child.process is not None and child.process.poll() is None
            status = "running" if running else ("down" if child.down_on_request else "restarting")
            state[name] = {"pid": self._pid(child), "state": status, "restarts": child.restarts}
        path = self.control / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(path)  # readers never see half a file


# --- the commands other processes use --------------------------------------------------
def read_state(var_dir: Path) -> dict[str, Any]:
    path = control_dir(var_dir) / STATE_FILE
    if not path.exists():
        raise RuntimeError(f"the demo is not running ({path} is missing): start `make demo`")
    state: dict[str, Any] = json.loads(path.read_text())
    return state


def _known(var_dir: Path, name: str) -> dict[str, Any]:
    state = read_state(var_dir)
    if name not in state:
        raise RuntimeError(f"no demo process {name!r}; the demo runs {', '.join(sorted(state))}")
    entry: dict[str, Any] = state[name]
    return entry


def request_stop(var_dir: Path, name: str) -> None:
    """Take `name` down and keep it down until request_start."""
    _known(var_dir, name)
    (control_dir(var_dir) / f"{name}.down").touch()


def request_start(var_dir: Path, name: str) -> None:
    _known(var_dir, name)
    with contextlib.suppress(FileNotFoundError):
        (control_dir(var_dir) / f"{name}.down").unlink()


def kill(var_dir: Path, name: str) -> int:
    """SIGKILL the running process group of `name`, as a crash would. Returns the pid."""
    entry = _known(var_dir, name)
    if entry["state"] != "running" or not entry["pid"]:
        raise RuntimeError(f"{name} is not running ({entry['state']})")
    os.killpg(int(entry["pid"]), signal.SIGKILL)
    return int(entry["pid"])


def wait_for(var_dir: Path, name: str, state: str, *, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until the supervisor reports `name` in `state` (running, down, restarting)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(RuntimeError, ValueError):
            entry = _known(var_dir, name)
            if entry["state"] == state:
                return entry
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not reach {state!r} within {timeout:.0f}s")
        time.sleep(0.2)


def control_main(var_dir: Path, argv: list[str]) -> int:
    """`demo.py status|stop NAME|start NAME|kill NAME` against the running demo."""
    command, *names = argv
    try:
        if command == "status":
            for name, entry in read_state(var_dir).items():
                state, pid, restarts = entry["state"], entry["pid"], entry["restarts"]
                print(f"{name:<12} {state:<11} pid {pid}  restarts {restarts}")
            return 0
        if command not in {"stop", "start", "kill"} or len(names) != 1:
            print("usage: demo.py [status | stop NAME | start NAME | kill NAME]", file=sys.stderr)
            return 2
        name = names[0]
        if command == "stop":
            request_stop(var_dir, name)
            print(f"{name}: stop requested; it stays down until `demo.py start {name}`")
        elif command == "start":
            request_start(var_dir, name)
            print(f"{name}: start requested")
        else:
            pid = kill(var_dir, name)
            print(f"{name}: killed pid {pid} (SIGKILL); restarted unless DEMO_RESTART=never")
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    return 0
