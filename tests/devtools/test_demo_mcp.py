"""`make demo` as a reader of the README runs it, then `demo_agent.py --mcp` in a second
terminal: the real demo (scripts/demo.py on its embedded defaults: its chain, web, MCP server,
worker and the sample upstream as supervised processes) and the official x402 MCP client.
The upstream's own count shows one effect, and the agent's repeated call none more."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from devtools.sample_upstream import DEMO_OFFERING

ROOT = Path(__file__).resolve().parents[2]
BANNER_END = "Ctrl-C stops everything."


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _demo_env(var: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    ports = {
        name: str(_free_port())
        for name in ("DEMO_PORT", "DEMO_MCP_PORT", "DEMO_JOB_SERVICE_PORT", "DEMO_UPSTREAM_PORT")
    }
    return {**env, **ports, "TOLLBOOTH_VAR_DIR": str(var), "DEMO_RESTART": "never"}


@pytest.fixture
def running_demo(tmp_path: Path) -> Iterator[tuple[dict[str, str], str]]:
    """scripts/demo.py until its banner is printed; SIGTERM (as Ctrl-C) afterwards."""
    env = _demo_env(tmp_path)
    out = (tmp_path / "demo.out").open("w+")
    demo = subprocess.Popen(
        [sys.executable, "scripts/demo.py"], cwd=ROOT, env=env, stdout=out, stderr=out
    )
    try:
        deadline = time.monotonic() + 240
        while BANNER_END not in (tmp_path / "demo.out").read_text():
            assert demo.poll() is None, (tmp_path / "demo.out").read_text()
            assert time.monotonic() < deadline, (tmp_path / "demo.out").read_text()
            time.sleep(0.5)
        yield env, (tmp_path / "demo.out").read_text()
    finally:
        demo.send_signal(signal.SIGTERM)
        try:
            demo.wait(timeout=60)
        except subprocess.TimeoutExpired:
            demo.kill()
        out.close()


def _agent_mcp(env: dict[str, str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "scripts/demo_agent.py", "--mcp"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def _line(lines: list[str], head: str) -> str:
    return next(line for line in lines if line.startswith(head + " "))[len(head) + 1 :]


def test_demo_agent_mcp_buys_from_the_demo_upstream_once(running_demo) -> None:
    env, banner = running_demo
    mcp_url = f"http://127.0.0.1:{env['DEMO_MCP_PORT']}/mcp"
    assert f"MCP tools      {mcp_url}" in banner
    assert f"offering {DEMO_OFFERING!r} runs on the sample upstream" in banner
    chain = json.loads((Path(env["TOLLBOOTH_VAR_DIR"]) / "demo-chain.json").read_text())
    stats_url = chain["upstream"]["stats_url"]
    assert requests.get(stats_url, timeout=5).json()["effects"] == 0

    first = _agent_mcp(env)

    purchase = _line(first, "purchase")
    assert purchase.startswith("pur_")
    result = json.loads(_line(first, "result"))
    # The upstream's own answer: the purchase's key, its first effect, the agent's input.
    assert result == {
        "key": f"tollbooth-{purchase}",
        "effect": 1,
        "input": {"message": "hello from the demo agent"},
    }
    assert _line(first, "upstream effects") == "1 calls 1"
    assert _line(first, "paid").startswith("ok settlement 0x")

    # The stock client re-signs the same call: answered from the same purchase, not run again.
    again = _agent_mcp(env)
    assert _line(again, "duplicate of").startswith(purchase)
    assert _line(again, "purchase") == purchase
    assert _line(again, "upstream effects") == "1 calls 1"
    assert requests.get(stats_url, timeout=5).json() == {
        "effects": 1,
        "calls": 1,
        "replayed": 0,
        "refused": 0,
    }
