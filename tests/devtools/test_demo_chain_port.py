"""`DEMO_CHAIN_PORT` sets the demo chain's RPC port (scripts/demo.py), for clients that need
a fixed URL; unset, anvil picks a free one."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _demo_script(monkeypatch: pytest.MonkeyPatch, **env: str) -> ModuleType:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location(
        "demo_script_under_test", ROOT / "scripts/demo.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_chain_port_sets_the_chain_rpc_port(monkeypatch, tmp_path):
    port = _free_port()
    demo = _demo_script(monkeypatch, DEMO_CHAIN_PORT=str(port), TOLLBOOTH_VAR_DIR=str(tmp_path))
    node, chain = demo.start_chain()
    try:
        assert chain["rpc_url"] == f"http://127.0.0.1:{port}"
        assert node.w3().eth.chain_id == 31337
    finally:
        node.stop()
