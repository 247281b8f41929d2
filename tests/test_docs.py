"""The docs show the code CI runs: the stock-client examples are embedded verbatim."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "example",
    [
        "docs/examples/x402_buy.py",
        "docs/examples/x402-buy.mjs",
        "docs/examples/x402_buy_with_payment_id.py",
        "docs/examples/x402_sign_in.py",
    ],
)
def test_x402_guide_embeds_the_example_that_ci_runs(example: str) -> None:
    code = (ROOT / example).read_text().rstrip("\n")
    assert code in (ROOT / "docs/x402.md").read_text()


# --- the support runbook: written from the case file, showing each situation's page ---------
RUNBOOK = ROOT / "docs/runbook.md"


def test_runbook_reason_codes_are_the_case_files() -> None:
    from backoffice.management.commands.case_table import (
        RUNBOOK_END,
        RUNBOOK_START,
        runbook_reason_section,
    )

    text = RUNBOOK.read_text()
    start, end = text.index(RUNBOOK_START), text.index(RUNBOOK_END) + len(RUNBOOK_END)
    assert text[start:end] == runbook_reason_section(), (
        "docs/runbook.md drifted from purchases/case_file.py: paste in the output of "
        "`manage.py case_table --format runbook`"
    )


def test_runbook_names_every_reason_code_with_an_owner_and_a_safe_action() -> None:
    from purchases.case_file import (
        ERROR_CODES_ABOUT_A_PURCHASE,
        REASON_CODES,
        REASON_MOVES,
        case_reason_codes,
    )

    explained = set(REASON_CODES) | {c.value for c in ERROR_CODES_ABOUT_A_PURCHASE}
    assert set(REASON_MOVES) == explained
    assert all(action for _owner, action in REASON_MOVES.values())
    text = RUNBOOK.read_text()
    missing = {code for code in case_reason_codes() if f"`{code}`" not in text}
    assert not missing, missing


def test_runbook_shows_every_situation_and_its_screenshot() -> None:
    from devtools.situations import SITUATIONS

    text = RUNBOOK.read_text()
    for name in SITUATIONS:
        assert f"(screenshots/{name}.png)" in text, name
        assert (ROOT / "docs/screenshots" / f"{name}.png").is_file(), name
    for shot in (ROOT / "docs/screenshots").glob("*.png"):
        assert f"(screenshots/{shot.name})" in text, f"{shot.name} is not shown in the runbook"


def test_finance_guide_names_every_payback_code() -> None:
    from payments.rails.x402.payback import PaybackCode

    guide = (ROOT / "docs/finance.md").read_text()
    missing = [code.value for code in PaybackCode if f"`{code.value}`" not in guide]
    # `payback_closes` is the timeline's reason for a close, named in the text.
    assert missing == []


def test_finance_guide_names_every_payout_wait_and_proven_failure() -> None:
    from payments.models import PROVABLE_FAILURES
    from payments.payouts import Awaiting

    guide = (ROOT / "docs/finance.md").read_text()
    names = [a.value for a in Awaiting] + list(PROVABLE_FAILURES)
    assert [name for name in names if f"`{name}`" not in guide] == []
