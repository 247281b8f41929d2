"""The docs show the code CI runs: the stock-client examples are embedded verbatim."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("example", ["docs/examples/x402_buy.py", "docs/examples/x402-buy.mjs"])
def test_x402_guide_embeds_the_example_that_ci_runs(example: str) -> None:
    code = (ROOT / example).read_text().rstrip("\n")
    assert code in (ROOT / "docs/x402.md").read_text()
