"""The purchase page's "Download evidence pack" (issue 33, part 3), through the admin views:
support and finance download the signed pack, each download on the timeline (who, when,
the file's SHA-256) before the file is sent; a staff member without either role, a GET and
an unknown purchase get no pack and leave nothing recorded."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
from django.contrib.auth.models import Group, User
from django.test import Client
from django.urls import reverse

from backoffice.roles import roles_ensure
from fulfillment.evidence_seal import pack_verify
from fulfillment.receipt_signing import published_keys
from purchases import event_subjects
from purchases.models import Purchase
from tests.admin.test_admin import World

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]


def _url(purchase: Purchase) -> str:
    return reverse("admin:purchases_purchase_evidence_pack", args=[purchase.pk])


def _page(client: Client, purchase: Purchase) -> str:
    response = client.get(reverse("admin:purchases_purchase_change", args=[purchase.pk]))
    assert response.status_code == 200
    return response.content.decode()


def _exports(purchase: Purchase) -> list[tuple[str, str, str]]:
    return [
        (e.actor_type, e.actor, e.reason_code)
        for e in purchase.events.filter(subject=event_subjects.EVIDENCE_EXPORTED)
    ]


@pytest.mark.parametrize(
    ("who", "name"), [("support", "sam-support"), ("finance", "fay-finance"), ("superuser", "root")]
)
def test_support_and_finance_download_the_pack_and_it_is_on_the_timeline(
    request, world: World, who: str, name: str
):
    client: Client = request.getfixturevalue(who)
    purchase = world.prepaid
    page = _page(client, purchase)
    assert 'data-testid="case-evidence-pack"' in page
    form = re.search(r'<form method="post" action="([^"]+)" id="case-form-evidence-pack">', page)
    assert form is not None and form.group(1) == _url(purchase)

    response = client.post(_url(purchase))

    assert response.status_code == 200
    assert response["Content-Type"] == "application/json; charset=utf-8"
    assert response["Content-Disposition"] == f'attachment; filename="evidence-{purchase.ref}.json"'
    pack = json.loads(response.content)
    addresses = [key.address for key in published_keys()]
    assert pack_verify(pack, addresses=addresses) == addresses[0]
    assert pack["content"]["purchase"]["ref"] == purchase.ref
    assert [r["reasonCode"] for r in pack["content"]["refunds"]] == ["goodwill"]
    assert _exports(purchase) == [("staff", name, "admin")]
    exported = purchase.events.get(subject=event_subjects.EVIDENCE_EXPORTED)
    assert exported.evidence["pack_sha256"] == hashlib.sha256(response.content).hexdigest()
    assert response["X-Content-SHA256"] == exported.evidence["pack_sha256"]
    # The page's timeline says who took it.
    assert "Evidence pack downloaded" in _page(client, purchase)


def test_a_staff_member_without_a_role_gets_no_pack_and_nothing_is_recorded(world: World):
    user = User.objects.create_user(username="nobody", is_staff=True)
    client = Client()
    client.force_login(user)

    response = client.post(_url(world.prepaid))

    assert response.status_code == 403
    assert _exports(world.prepaid) == []


def test_a_get_or_an_unknown_purchase_downloads_nothing(world: World, support: Client):
    assert support.get(_url(world.prepaid)).status_code == 405
    missing = reverse("admin:purchases_purchase_evidence_pack", args=[999_999_999])
    assert support.post(missing).status_code == 404
    assert _exports(world.prepaid) == []


def test_the_download_needs_the_csrf_token(world: World):
    roles_ensure()
    user = User.objects.create_user(username="csrf-sam", is_staff=True)
    user.groups.add(Group.objects.get(name="support"))
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)

    assert client.post(_url(world.prepaid)).status_code == 403
    assert _exports(world.prepaid) == []
