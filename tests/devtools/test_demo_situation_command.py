"""`manage.py demo_situation`: names the twelve, and says what is missing without a demo.
(Each situation is played for real by tests/browser/test_situations.py.)"""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from devtools.situations import SITUATIONS


def test_list_names_the_twelve_situations() -> None:
    out = io.StringIO()
    call_command("demo_situation", "--list", stdout=out)
    names = [line.split()[0] for line in out.getvalue().splitlines() if not line.startswith(" ")]
    assert names == list(SITUATIONS) and len(names) == 12


def test_list_gives_each_description_whole_and_wrapped() -> None:
    out = io.StringIO()
    call_command("demo_situation", "--list", stdout=out)
    listed = out.getvalue()
    assert all(len(line) <= 100 for line in listed.splitlines())
    text = " ".join(listed.split())
    for name, play in SITUATIONS.items():
        whole = " ".join((play.__doc__ or "").strip().split("\n\n")[0].split())
        assert whole.endswith("."), name  # a sentence, ended
        assert f"{name} {whole}" in text, name


def test_without_a_running_demo_it_says_to_start_one(settings, tmp_path) -> None:
    settings.VAR_DIR = tmp_path
    with pytest.raises(CommandError, match=r"no running demo found .* start `make demo` first"):
        call_command("demo_situation", "worker-killed")


def test_a_situation_or_all_must_be_named(settings, tmp_path) -> None:
    settings.VAR_DIR = tmp_path
    with pytest.raises(CommandError, match="name a situation"):
        call_command("demo_situation")
