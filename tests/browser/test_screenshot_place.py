"""Where the browser tests save their pages: var/screenshots unless a refresh is asked for,
so a test run never rewrites the runbook's tracked pictures."""

from __future__ import annotations

import pytest

from tests.browser.conftest import (
    DOCS_SCREENSHOTS,
    REFRESH_SCREENSHOTS_ENV,
    ROOT,
    SCREENSHOTS,
    screenshots_dir,
)


def test_a_test_run_saves_its_pages_outside_the_tracked_tree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(REFRESH_SCREENSHOTS_ENV, raising=False)
    assert screenshots_dir() == SCREENSHOTS == ROOT / "var" / "screenshots"
    assert "var/" in (ROOT / ".gitignore").read_text().splitlines()  # gitignored


def test_the_runbooks_pictures_are_rewritten_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(REFRESH_SCREENSHOTS_ENV, "1")
    assert screenshots_dir() == DOCS_SCREENSHOTS == ROOT / "docs" / "screenshots"
    monkeypatch.setenv(REFRESH_SCREENSHOTS_ENV, "0")
    assert screenshots_dir() == SCREENSHOTS
