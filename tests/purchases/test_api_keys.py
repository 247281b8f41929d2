"""API keys: the key names its buyer, and a revoked key or an inactive buyer is refused at
the very next request (the look-up is a fixed SQL statement, read every time, never cached)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from purchases.models import ApiKey
from purchases.services.shared.buyers import api_key_authenticate, api_key_issue, api_key_revoke
from tests.factories import BuyerFactory

pytestmark = pytest.mark.django_db


def test_a_key_names_its_buyer_in_one_statement():
    buyer = BuyerFactory.create(spend_cap=500)
    raw_key = api_key_issue(buyer=buyer)
    with CaptureQueriesContext(connection) as queries:
        found = api_key_authenticate(raw_key=raw_key)
        assert found is not None
        # Every field came with the row: reading them costs no further statement.
        seen = (found.pk, found.ref, found.name, found.spend_cap, found.is_active, found.created_at)
    assert len(queries) == 1
    assert seen == (buyer.pk, buyer.ref, buyer.name, 500, True, buyer.created_at)
    assert found.created_at.tzinfo is not None
    assert not hasattr(found, "api_key_hash")


def test_a_revoked_key_is_refused_at_the_next_request(client_for_buyer, buyer):
    assert client_for_buyer.get("/api/v1/offerings").status_code == 200
    api_key_revoke(key=ApiKey.objects.get(buyer=buyer))
    refused = client_for_buyer.get("/api/v1/offerings")
    assert (refused.status_code, refused.json()["code"]) == (401, "not_authenticated")


def test_an_inactive_buyer_a_wrong_secret_and_a_malformed_key_are_refused():
    buyer = BuyerFactory.create()
    raw_key = api_key_issue(buyer=buyer)
    prefix = raw_key.split("_")[1]
    assert api_key_authenticate(raw_key=raw_key) == buyer
    assert api_key_authenticate(raw_key=f"tbk_{prefix}_not-the-secret") is None
    assert api_key_authenticate(raw_key=f"xyz_{prefix}_{raw_key.split('_', 2)[2]}") is None
    assert api_key_authenticate(raw_key="tbk_nothere_secret") is None
    buyer.is_active = False
    buyer.save(update_fields=["is_active"])
    assert api_key_authenticate(raw_key=raw_key) is None


def test_of_two_keys_only_the_revoked_one_is_refused():
    buyer = BuyerFactory.create()
    kept, revoked = api_key_issue(buyer=buyer), api_key_issue(buyer=buyer)
    ApiKey.objects.filter(prefix=revoked.split("_")[1]).update(revoked_at=timezone.now())
    assert api_key_authenticate(raw_key=kept) == buyer
    assert api_key_authenticate(raw_key=revoked) is None
