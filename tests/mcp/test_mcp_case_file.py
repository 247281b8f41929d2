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
