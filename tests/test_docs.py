"""The docs show the code CI runs: the stock-client examples are embedded verbatim."""

from __future__ import annotations

import json
import re
import subprocess
import sys
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
        "docs/examples/x402_top_up.py",
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


# --- docs/going-live.md: every name it tells an operator to set or run exists ---------------
GOING_LIVE = ROOT / "docs/going-live.md"
ENV_NAME = re.compile(r"\b(?:X402|TOLLBOOTH|DJANGO|CDP|DATABASE|REDIS)_[A-Z0-9_]*[A-Z0-9]\b")

# Run in a process of its own: every variable config/settings/base.py reads through
# django-environ, however its name is built (`f"{prefix}CDP_API_KEY_ID"`).
_SETTINGS_READS = """
import json, environ
names = set()
get_value = environ.Env.get_value
def recording(self, var, *args, **kwargs):
    names.add(var)
    return get_value(self, var, *args, **kwargs)
environ.Env.get_value = recording
import config.settings.base
print(json.dumps(sorted(names)))
"""


def _variables_read() -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", _SETTINGS_READS], cwd=ROOT, capture_output=True, text=True,
        check=True, timeout=60,
    )  # fmt: skip
    named = set(json.loads(done.stdout.strip().splitlines()[-1]))
    # Read with os.environ (production's refusals, the gunicorn configurations).
    for source in (ROOT / "config").rglob("*.py"):
        named |= set(ENV_NAME.findall(source.read_text()))
    return named


def test_going_live_names_only_variables_the_settings_read() -> None:
    named = set(ENV_NAME.findall(GOING_LIVE.read_text()))
    assert "X402_BASE_RELAYER_MIN_GAS" in named and "CDP_API_KEY_SECRET" in named
    assert sorted(named - _variables_read()) == []


def test_going_live_names_only_commands_targets_and_metrics_that_exist() -> None:
    from django.core.management import get_commands

    text = GOING_LIVE.read_text()
    commands = set(re.findall(r"manage\.py (\w+)", text))
    assert {"books_export", "receipt_verify", "offerings"} <= commands
    assert sorted(commands - set(get_commands())) == []
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"`make (\w[\w-]*)", text))
    assert sorted(t for t in targets if f"\n{t}:" not in makefile) == []
    metrics = set(re.findall(r"`(tollbooth_[a-z_]+)`", text))
    sources = "".join(
        path.read_text() for app in ("backoffice", "core", "payments", "purchases")
        for path in (ROOT / app).rglob("*.py")
    )  # fmt: skip
    assert len(metrics) >= 15 and sorted(m for m in metrics if f'"{m}' not in sources) == []
