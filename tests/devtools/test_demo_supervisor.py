"""`make demo` keeps running when one of its processes dies: real child processes, killed
with SIGKILL through the same control files `demo.py kill|stop|start` use."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools import supervisor as sv

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


class Running:
    def __init__(self, tmp_path: Path, restart: bool) -> None:
        self.var = tmp_path
        self.lines: list[str] = []
        specs = [
            sv.ProcessSpec(name, SLEEPER, dict(os.environ), tmp_path) for name in ("web", "worker")
        ]
        self.supervisor = sv.Supervisor(
            specs, var_dir=tmp_path, restart=restart, say=self.lines.append
        )
        self.stopped = threading.Event()
        self.supervisor.start_all()
        self.thread = threading.Thread(
            target=self.supervisor.run, args=(self.stopped.is_set, 0.05), daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)
        self.supervisor.stop_all()


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Running]:
    running = Running(tmp_path, restart=True)
    yield running
    running.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_process_is_announced_in_one_line_and_restarted(demo: Running) -> None:
    first = sv.wait_for(demo.var, "worker", "running")["pid"]
    web_pid = sv.read_state(demo.var)["web"]["pid"]

    assert sv.kill(demo.var, "worker") == first
    sv.wait_for(demo.var, "worker", "restarting", timeout=10)
    again = sv.wait_for(demo.var, "worker", "running", timeout=15)

    assert again["pid"] != first and again["restarts"] == 1
    assert sv.read_state(demo.var)["web"]["pid"] == web_pid  # the others were not touched
    assert demo.lines[0].startswith("[demo] worker exited with -9; restarting in 1s")
    assert demo.lines[1] == f"[demo] worker restarted (pid {again['pid']})"


def test_stop_keeps_it_down_until_start(demo: Running) -> None:
    first = sv.wait_for(demo.var, "worker", "running")["pid"]

    sv.request_stop(demo.var, "worker")
    down = sv.wait_for(demo.var, "worker", "down", timeout=20)
    assert not _alive(first) and down["restarts"] == 0
    assert "stopped on request" in demo.lines[0]

    sv.request_start(demo.var, "worker")
    back = sv.wait_for(demo.var, "worker", "running", timeout=10)
    assert back["pid"] != first and _alive(back["pid"])


def test_demo_restart_never_leaves_a_dead_process_down(tmp_path: Path) -> None:
    assert sv.restart_policy_from_env({"DEMO_RESTART": "never"}) is False
    assert sv.restart_policy_from_env({}) is True
    running = Running(tmp_path, restart=False)
    try:
        sv.kill(tmp_path, "worker")
        sv.wait_for(tmp_path, "worker", "down", timeout=10)
        assert "left down (DEMO_RESTART=never)" in running.lines[0]
        assert sv.read_state(tmp_path)["web"]["state"] == "running"
    finally:
        running.close()


def test_control_commands_name_what_is_wrong(tmp_path: Path, capsys) -> None:
    assert sv.control_main(tmp_path, ["kill", "worker"]) == 1
    assert "the demo is not running" in capsys.readouterr().err
    running = Running(tmp_path, restart=True)
    try:
        assert sv.control_main(tmp_path, ["stop", "nginx"]) == 1
        assert "no demo process 'nginx'" in capsys.readouterr().err
        assert sv.control_main(tmp_path, ["status"]) == 0
        assert "worker" in capsys.readouterr().out
    finally:
        running.close()
