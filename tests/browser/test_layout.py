"""Every admin page support and finance open fits a 1366x768 support laptop: nothing
scrolls sideways, neither the page nor a table or box inside it, and no box cuts what it
holds, with the longest values the pages show (wallets, tx hashes, payment ids, pay-back
references, facilitator reason codes, job refs, notes) and the navigation sidebar and the
filters open. The refund list and the purchase page are also checked on the situations
played on the chain; every page (admin_pages.py) on rows written at their longest
(admin_rows.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from django.contrib import admin
from django.core.management import call_command
from django.urls import URLPattern, URLResolver, reverse

from backoffice.admin.case_actions import FORMS
from backoffice.roles import FINANCE, ROLE_TABLE, SUPPORT
from devtools.situations import transfer_after_failure, two_authorizations_for_one_quote
from payments.models import Refund
from purchases.models import Purchase
from tests.browser.admin_pages import CASE_ACTION, PAGES, AdminPage
from tests.browser.admin_rows import layout_world_build
from tests.browser.conftest import BrowserWorld, app_served, staff_context
from tests.factories import refund_paid_back

LAPTOP = {"width": 1366, "height": 768}
PAYBACK_TX = "0x" + "ab" * 32

# What does not fit: (what, content width, the width it has). The page, every table in
# the content (wider than its box, or its wrapper scrolls: overflow even when the page does
# not scroll), and any box that scrolls sideways or cuts what it holds (a form row hides a
# hash too long for it). Form fields scroll their own text by nature; empty boxes cut nothing.
OVERFLOW = """() => {
  const root = document.documentElement;
  const found = [["page", root.scrollWidth, root.clientWidth]];
  const name = (box) => box.id || (box.closest("[id]").id + " " + box.tagName.toLowerCase()
    + (box.className ? "." + String(box.className).trim().split(/\\s+/).join(".") : ""));
  for (const table of document.querySelectorAll("#content table")) {
    const box = table.parentElement;
    found.push([name(table), Math.ceil(table.getBoundingClientRect().width), box.clientWidth]);
    found.push([name(table) + " wrapper", box.scrollWidth, box.clientWidth]);
  }
  for (const box of document.querySelectorAll("#main *")) {
    // Text only screen readers get (1 px, clipped on purpose) is not cut for anyone.
    if (box.matches("input, textarea, select, option") || box.closest(".visually-hidden")) continue;
    if (box.clientWidth > 0 && getComputedStyle(box).overflowX !== "visible")
      found.push([name(box), box.scrollWidth, box.clientWidth]);
  }
  return found;
}"""


def overflowing(page: Any) -> list[list[Any]]:
    return [row for row in page.evaluate(OVERFLOW) if row[1] > row[2]]


def test_refund_list_and_purchase_page_fit_1366_pixels(
    browser_world: BrowserWorld, staff_page: Any
) -> None:
    late = transfer_after_failure(browser_world.stage)
    duplicate = two_authorizations_for_one_quote(browser_world.stage)
    # One refund paid back, so the list also shows a 66-character pay-back reference.
    paid = Refund.objects.get(purchase__ref=late.purchase_ref)
    refund_paid_back(paid, PAYBACK_TX, by="finance")
    pages = {
        "refunds owed": reverse("admin:payments_refund_changelist"),
        "all refunds": reverse("admin:payments_refund_changelist") + "?state=all",
    }
    for played in (late, duplicate):
        purchase = Purchase.objects.get(ref=played.purchase_ref)
        pages[played.situation] = reverse("admin:purchases_purchase_change", args=[purchase.pk])
    for role in ("support", "finance"):
        page = staff_page(role)
        page.set_viewport_size(LAPTOP)
        for name, url in pages.items():
            answer = page.goto(url)
            assert answer is not None and answer.status == 200, (role, name)
            assert page.locator("#result_list, #case-timeline").count() == 1, (role, name)
            assert overflowing(page) == [], (role, name)
        page.goto(pages["all refunds"])
        listing = page.locator("#result_list").inner_text()
        # Wrapped, not cut: the whole reference and both purchases are there to copy.
        assert PAYBACK_TX in listing
        assert {late.purchase_ref, duplicate.purchase_ref} <= set(listing.split())


# --- every admin page support and finance open ----------------------------------------------
def _open(page: Any, admin_page: AdminPage, pks: dict[str, int]) -> int:
    answer = page.goto(admin_page.url(pks))
    assert answer is not None
    if not admin_page.action:
        return int(answer.status)
    # An action's own page: ticked on the list, answered by the list's POST.
    page.check("#action-toggle")
    page.select_option("select[name=action]", admin_page.action)
    with page.expect_navigation() as posted:
        page.click("button[name=index]")
    assert page.locator("input[name=apply]").count() == 1
    return int(posted.value.status)


CASES = [
    pytest.param(role, admin_page, id=f"{role}: {admin_page.name}")
    for admin_page in PAGES
    for role in admin_page.roles
]


# Class-scoped: the rows are written once for TestEveryAdminPage and flushed before the
# module's other tests run.
@pytest.fixture(scope="class")
def layout_site(
    django_db_setup: None, django_db_blocker: Any
) -> Iterator[tuple[str, dict[str, int]]]:
    """The rows (each case only reads them) and the app serving them; the database is flushed
    afterwards, as after a transactional test."""
    with django_db_blocker.unblock():  # the server's threads read the rows throughout
        try:
            pks = layout_world_build()
            with app_served() as url:
                yield url, pks
        finally:
            call_command("flush", interactive=False, verbosity=0)


@pytest.fixture(scope="class")
def laptops(browser: Any, layout_site: tuple[str, dict[str, int]]) -> Iterator[dict[str, Any]]:
    """One signed-in page per role on a 1366x768 laptop, reused by every case."""
    url, _ = layout_site
    contexts = {role: staff_context(browser, url, role, LAPTOP) for role in (SUPPORT, FINANCE)}
    yield {role: context.new_page() for role, context in contexts.items()}
    for context in contexts.values():
        context.close()


# `django_db` tells pytest-django to make the test database; the rows are layout_site's.
@pytest.mark.django_db
class TestEveryAdminPage:
    """Each page support or finance opens, one page load per case, named by role and page."""

    @pytest.mark.parametrize(("role", "admin_page"), CASES)
    def test_fits_1366_pixels(
        self,
        role: str,
        admin_page: AdminPage,
        layout_site: tuple[str, dict[str, int]],
        laptops: Any,
    ) -> None:
        page = laptops[role]
        assert _open(page, admin_page, layout_site[1]) == 200
        if admin_page.url_name.endswith("_changelist") and not admin_page.action:
            assert page.locator("#result_list tbody tr").count() >= 1  # rows, not "0 results"
        problems = overflowing(page)
        assert not problems, problems


# --- the catalogue misses nothing -------------------------------------------------------
# Admin URLs that are not a page a role reads: what each is instead.
NOT_PAGES = {
    "login": "the sign-in box, before any role",
    "logout": "a POST that signs out",
    "password_change_done": "one sentence after a password change",
    "autocomplete": "JSON for autocomplete widgets",
    "jsi18n": "the admin's script catalogue",
    "view_on_site": "a redirect",
    "purchases_offering_upstream_check": "a POST that checks the upstream and returns to the "
    "offering's page with what it found (the offering's page is in the catalogue)",
    "purchases_purchase_evidence_pack": "a POST answered with the signed evidence pack, a JSON "
    "file, not a page (tests/admin/test_evidence_admin.py)",
}
PURCHASE_LABEL = "purchases.purchase"
STANDARD = ("changelist", "add", "history", "delete", "change")  # each ModelAdmin's own
DOWNLOADS = {
    "export_csv": "a CSV file, not a page",
    "export_safe_batch": "a JSON file, not a page",
    "assign_to_me": "applied at once, back to the list (its message is the list's)",
    "confirm_payback_match": "applied at once, back to the list (its message is the list's)",
    "approve_second_payout": "applied at once, back to the list (its message is the list's)",
    "cancel_payout": "applied at once, back to the list (its message is the list's)",
}


def _url_names(patterns: Sequence[URLPattern | URLResolver]) -> set[str]:
    names = set()
    for entry in patterns:
        if isinstance(entry, URLResolver):
            names |= _url_names(entry.url_patterns)
        elif entry.name:
            names.add(entry.name)
    return names


def test_the_layout_cases_cover_every_page_support_and_finance_open() -> None:
    covered = {(role, p.url_name) for p in PAGES for role in p.roles}
    model_admins = admin.site._registry
    wanted = set()
    for model, model_admin in model_admins.items():
        prefix = f"admin:{model._meta.app_label}_{model._meta.model_name}"
        for role in (SUPPORT, FINANCE):
            scope = ROLE_TABLE[role].get(model._meta.label_lower)
            if scope is None:
                continue  # superusers' page (auth, axes, adding offerings)
            wanted |= {(role, f"{prefix}_{view}") for view in ("changelist", "change", "history")}
            # A list action that answers with a page of its own is a case of its own.
            for action in set(model_admin.actions or ()) & (scope.actions - set(DOWNLOADS)):
                assert any(p.action == action and role in p.roles for p in PAGES), action
    assert wanted - covered == set()
    # Every other view: the site's own pages and the extra views (dashboard, case actions,
    # resolve, top up) of the ModelAdmins a role sees.
    site = {entry.name for entry in admin.site.get_urls() if isinstance(entry, URLPattern)}
    extra = {
        name
        for model, model_admin in model_admins.items()
        if any(model._meta.label_lower in ROLE_TABLE[role] for role in (SUPPORT, FINANCE))
        for name in _url_names(model_admin.get_urls())
        if not name.endswith(tuple(f"_{view}" for view in STANDARD))
    }
    others = {f"admin:{name}" for name in (site | extra) - set(NOT_PAGES) if name}
    assert others - {p.url_name for p in PAGES} == set()
    # Each case action with a form of its own, for the role the table grants it to.
    for action in FORMS:
        opened = {
            r for p in PAGES if p.url_name == CASE_ACTION and action in p.args for r in p.roles
        }
        granted = {
            role
            for role in (SUPPORT, FINANCE)
            if action in ROLE_TABLE[role][PURCHASE_LABEL].actions
        }
        assert opened == granted, action
