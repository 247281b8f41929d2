"""The pages a model's admin adds beside its change list (an action's form, the books export,
the top-up) share one frame, templates/admin/model_page.html: the model's body class and the
breadcrumbs Home > app > model > the page. Each page says only its own crumb and content."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from payments.models import ExportBatch, LedgerEntry
from purchases.models import Escalation
from tests.factories import EscalationFactory

pytestmark = [pytest.mark.django_db]
TEMPLATES = Path(__file__).resolve().parents[2] / "templates"
CRUMBS = re.compile(r'<div class="breadcrumbs">(.*?)</div>', re.S)


@pytest.fixture
def staff() -> Client:
    user = User.objects.create_user(username="ada-admin", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(user)
    return client


def _frame(page: str) -> tuple[list[str], str]:
    """The breadcrumbs' link targets and last crumb, and the body's classes."""
    (crumbs,) = CRUMBS.findall(page)
    links = re.findall(r'href="([^"]+)"', crumbs)
    last = html.unescape(re.sub(r"<[^>]+>", "", crumbs)).split("\u203a")[-1].strip()
    (body,) = re.findall(r'<body class="([^"]*)"', page)
    return [*links, last], body


@pytest.mark.parametrize(
    ("model", "url_name", "crumb"),
    [
        (ExportBatch, "admin:payments_exportbatch_books", "Books"),
        (LedgerEntry, "admin:payments_ledgerentry_top_up", "Top up"),
        (Escalation, "admin:purchases_escalation_resolve", "Resolve"),
    ],
)
def test_each_page_is_framed_by_its_model(staff: Client, model, url_name: str, crumb: str) -> None:
    meta = model._meta
    args = [EscalationFactory.create().pk] if model is Escalation else []
    page = staff.get(reverse(url_name, args=args))
    assert page.status_code == 200
    trail, body = _frame(page.content.decode())
    assert trail == [
        reverse("admin:index"),
        reverse("admin:app_list", kwargs={"app_label": meta.app_label}),
        reverse(f"admin:{meta.app_label}_{meta.model_name}_changelist"),
        crumb,
    ]
    assert f"app-{meta.app_label}" in body.split() and f"model-{meta.model_name}" in body.split()


def test_the_frame_is_written_once() -> None:
    framed = sorted(
        str(path.relative_to(TEMPLATES))
        for path in TEMPLATES.rglob("*.html")
        if "admin:app_list" in path.read_text()
    )
    assert framed == ["admin/model_page.html"]
