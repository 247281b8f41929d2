"""The demo's chain is ready for `upto` (issue 34, part 2): Permit2 and the upto proxy at the
SDK's canonical addresses, and both demo buyers' Permit2 approval already sent, so a stock
client buys `upto` at once."""

from __future__ import annotations

from devtools.permit2 import (
    MAX_UINT256,
    PERMIT2,
    UPTO_PROXY,
    permit2_allowance,
    permit2_domain_separator,
    read_domain_separator,
)
from tests.devtools.test_demo_chain_port import _demo_script


def test_the_demo_chain_has_permit2_the_proxy_and_approved_buyers(monkeypatch, tmp_path):
    monkeypatch.delenv("DEMO_CHAIN_BLOCK_TIME", raising=False)
    demo = _demo_script(monkeypatch, TOLLBOOTH_VAR_DIR=str(tmp_path))
    node, chain = demo.start_chain()
    try:
        w3 = node.w3()
        assert (chain["permit2"], chain["upto_proxy"]) == (PERMIT2, UPTO_PROXY)
        assert read_domain_separator(w3) == permit2_domain_separator(chain["chain_id"])
        assert len(w3.eth.get_code(UPTO_PROXY)) > 0
        for buyer in chain["buyers"]:
            assert permit2_allowance(w3, chain["token"], buyer["address"]) == MAX_UINT256
        assert permit2_allowance(w3, chain["token"], chain["seller"]) == 0
    finally:
        node.stop()
