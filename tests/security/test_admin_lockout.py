"""The admin login locks a (username, address) pair out after repeated failures (issue 8, 9)."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client

pytestmark = pytest.mark.django_db
PASSWORD = "correct horse battery staple"


def login(username: str, password: str, address: str = "203.0.113.7") -> int:
    client = Client(REMOTE_ADDR=address)
    response = client.post(
        "/admin/login/?next=/admin/", {"username": username, "password": password}
    )
    return response.status_code


def test_repeated_failed_logins_lock_the_pair_out():
    User.objects.create_user("sam-support", password=PASSWORD, is_staff=True)
    limit = settings.AXES_FAILURE_LIMIT
    assert limit == 5  # the production default: tests run with it
    assert login("sam-support", PASSWORD) == 302  # a good login works (and resets the count)
    statuses = [login("sam-support", f"guess-{n}") for n in range(limit)]
    assert statuses == [200] * (limit - 1) + [429]
    # Locked: even the right password is refused from that address, and no session starts.
    assert login("sam-support", PASSWORD) == 429
    # The same account from another address, and another account, are not locked.
    assert login("sam-support", PASSWORD, address="198.51.100.9") == 302
    User.objects.create_user("fin-finance", password=PASSWORD, is_staff=True)
    assert login("fin-finance", PASSWORD) == 302
