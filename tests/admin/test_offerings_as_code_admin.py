"""The admin and offerings as code (issue 35, part 2): it shows which offerings a catalog
file owns; an edit of one is allowed (on-call may need it now), is on record, warns that the
file wins, and the next apply of the file puts the file's values back, saying so."""

from __future__ import annotations

import hashlib
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from purchases.models import Offering, PurchaseEvent
from tests.admin.test_admin import _change, _changelist, _messages, _offering_form, _staff
from tests.factories import SELLER, USDC_LOCAL, OfferingFactory

pytestmark = [pytest.mark.django_db]

CATALOG = f"""\
tollbooth_catalog: 1
offerings:
  lookup:
    title: Company lookup
    price: "0.01 USDC"
    asset: "{USDC_LOCAL}"
    network: eip155:31337
    pay_to: "{SELLER}"
    executor: report
"""
SHA = hashlib.sha256(CATALOG.encode()).hexdigest()


@pytest.fixture
def superuser() -> Client:
    return _staff("root", superuser=True)


def _apply(tmp_path: Path) -> str:
    path = tmp_path / "catalog.yaml"
    path.write_text(CATALOG)
    out = StringIO()
    call_command("offerings", "apply", str(path), "--by", "deploy", stdout=out)
    return out.getvalue()


def test_the_admin_shows_which_offerings_a_file_owns(superuser: Client, tmp_path: Path) -> None:
    _apply(tmp_path)
    OfferingFactory.create(slug="by-hand")

    listing = superuser.get(_changelist(Offering)).content.decode()
    assert f"file catalog.yaml (sha256 {SHA[:12]})" in listing
    assert "the admin" in listing  # by-hand
    page = superuser.get(_change(Offering.objects.get(slug="lookup"))).content.decode()
    assert "Offerings as code" in page
    assert f"file catalog.yaml (sha256 {SHA[:12]})" in page
    by_file = superuser.get(_changelist(Offering) + "?catalog_file=catalog.yaml").content.decode()
    assert "lookup" in by_file and "by-hand" not in by_file


def test_an_admin_edit_of_a_file_owned_offering_holds_until_the_file_is_applied_again(
    superuser: Client, tmp_path: Path
) -> None:
    _apply(tmp_path)
    lookup = Offering.objects.get(slug="lookup")

    response = superuser.post(_change(lookup), {**_offering_form(lookup), "price": "30000"})

    assert response.status_code == 302, response.content
    lookup.refresh_from_db()
    assert (lookup.price, lookup.version, lookup.catalog_file) == (30_000, 2, "catalog.yaml")
    warning = _messages(superuser.get(reverse("admin:index")))
    assert any("managed by the catalog file catalog.yaml" in m for m in warning), warning
    edit = PurchaseEvent.objects.get(subject="offering.changed", actor_type="staff", actor="root")
    assert edit.evidence == {"offering": "lookup", "changed": {"price": [10_000, 30_000]}}

    out = _apply(tmp_path)  # the same file again: the file wins

    lookup.refresh_from_db()
    assert (lookup.price, lookup.version) == (10_000, 3)
    assert "~ lookup: terms version 2 -> 3\n    price: 0.03 USDC -> 0.01 USDC" in out
    back = PurchaseEvent.objects.filter(subject="offering.changed").last()
    assert back is not None
    assert (back.actor, back.evidence["file_sha256"]) == ("deploy", SHA)


def test_an_offering_added_in_the_admin_is_on_record_and_owned_by_the_admin(
    superuser: Client,
) -> None:
    template = OfferingFactory.build(slug="added")
    form = {**_offering_form(template), "slug": "added", "is_active": "on"}
    response = superuser.post(reverse("admin:purchases_offering_add"), form)

    assert response.status_code == 302, response.content
    added = Offering.objects.get(slug="added")
    assert (added.version, added.catalog_file) == (1, "")
    created = PurchaseEvent.objects.get(subject="offering.created")
    assert (created.actor_type, created.actor, created.evidence["offering"]) == (
        "staff",
        "root",
        "added",
    )
    assert created.evidence["fields"]["price"] == 250_000
