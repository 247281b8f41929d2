"""The admin's upstream block sets "passes the path through" (input mode `request`) on an
http upstream and refuses it on any other kind, naming the field."""

from __future__ import annotations

import pytest
from django.test import Client

from fulfillment.models import Upstream
from tests.admin.test_admin import _change, _offering_form, _upstream_fields, superuser
from tests.factories import OfferingFactory

__all__ = ["superuser"]  # the fixture, shared with the admin suite
pytestmark = pytest.mark.django_db


def test_the_admin_sets_an_http_upstream_to_pass_the_request_through(superuser: Client) -> None:
    offering = OfferingFactory.create()
    form = _offering_form(offering)
    page = superuser.get(_change(offering)).content.decode()
    assert "The paid request itself (passes the path through)" in page

    refused = superuser.post(
        _change(offering),
        {**form, **_upstream_fields(kind="mcp", tool="search", input_mode="request")},
    )
    assert refused.status_code == 200
    assert "Only an http upstream passes the paid request through." in refused.content.decode()
    assert not Upstream.objects.filter(offering=offering).exists()

    saved = superuser.post(_change(offering), {**form, **_upstream_fields(input_mode="request")})
    assert saved.status_code == 302, saved.content
    assert Upstream.objects.get(offering=offering).input_mode == "request"
