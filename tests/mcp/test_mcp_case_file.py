"""Support sees an MCP purchase like any other, with the door it came in by."""

from __future__ import annotations

import pytest
from django.test import Client

from purchases.models import Purchase
from tests.admin.test_admin import _change, _changelist, _staff
from tests.factories import PurchaseFactory

pytestmark = pytest.mark.django_db


def test_case_file_names_the_channel_and_the_list_filters_by_it(offering) -> None:
    support: Client = _staff("sam-support", "support")
    by_mcp = PurchaseFactory.create(quote__offering=offering, channel=Purchase.Channel.MCP)
    by_url = PurchaseFactory.create(quote__offering=offering)
    page = support.get(_change(by_mcp)).content.decode()
    assert "MCP tool call" in page
    assert "MCP tool call" not in support.get(_change(by_url)).content.decode()
    listed = support.get(_changelist(Purchase) + "?channel=mcp").content.decode()
    assert by_mcp.ref in listed and by_url.ref not in listed


def test_a_purchase_fetched_through_another_door_still_says_the_door_it_was_bought_on(
    offering,
) -> None:
    from purchases.models import PurchaseEvent

    support: Client = _staff("sam-support-2", "support")
    by_mcp = PurchaseFactory.create(quote__offering=offering, channel=Purchase.Channel.MCP)
    # Its result fetched later at the capability URL (HTTP): the delivery names that door.
    PurchaseEvent.objects.create(
        purchase=by_mcp,
        subject="result.delivered",
        actor_type="agent",
        actor="0xpayer",
        evidence={"channel": "capability_url", "bytes": 10},
    )
    page = support.get(_change(by_mcp)).content.decode()
    assert "<dt>bought on</dt>" in page
    assert "<dd>MCP tool call (later fetches: see each delivery)</dd>" in page
    assert "capability_url" in page  # the fetch's own door, on the timeline
    by_mcp.refresh_from_db()
    assert by_mcp.channel == Purchase.Channel.MCP  # set once, when bought
