"""`DEMO_CHAIN_BLOCK_TIME` gives the demo's chain (and the bench's) a real chain's clock: anvil
mines a block every N seconds, whether or not a transaction came; unset, a block per
transaction. A value that is not a number of seconds stops the demo with a clear message."""

from __future__ import annotations

import time

import pytest

from devtools.anvil import AnvilError, block_time_from_env
from tests.devtools.test_demo_chain_port import _demo_script


def _height(node) -> int:
    return int(node.rpc("eth_blockNumber"), 16)


def test_the_demo_chain_mines_on_its_clock(monkeypatch, tmp_path):
    demo = _demo_script(monkeypatch, DEMO_CHAIN_BLOCK_TIME="1", TOLLBOOTH_VAR_DIR=str(tmp_path))
    node, chain = demo.start_chain()
    try:
        assert chain["block_time"] == 1.0
        before = _height(node)
        # Nothing sent: only the clock mines. Two blocks take 2 s; the deadline waits for a
        # loaded machine, and an automining chain would never get there.
        deadline = time.monotonic() + 30
        while _height(node) < before + 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _height(node) >= before + 2
    finally:
        node.stop()


def test_unset_the_demo_chain_mines_a_block_per_transaction(monkeypatch, tmp_path):
    monkeypatch.delenv("DEMO_CHAIN_BLOCK_TIME", raising=False)
    demo = _demo_script(monkeypatch, TOLLBOOTH_VAR_DIR=str(tmp_path))
    node, chain = demo.start_chain()
    try:
        assert chain["block_time"] is None
        before = _height(node)
        time.sleep(1.5)
        assert _height(node) == before
    finally:
        node.stop()


@pytest.mark.parametrize("value", ["two", "-2"])
def test_a_block_time_that_is_not_seconds_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("DEMO_CHAIN_BLOCK_TIME", value)
    with pytest.raises(AnvilError, match="DEMO_CHAIN_BLOCK_TIME"):
        block_time_from_env()
