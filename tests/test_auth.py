"""core.auth.StaffGrantsBackend: a signed-in user comes with their groups and permissions
in one query, and every answer is the one Django's ModelBackend gives."""

from __future__ import annotations

import pytest
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.models import Group, Permission, User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from backoffice.roles import roles_ensure
from core.auth import StaffGrantsBackend, user_group_names

pytestmark = pytest.mark.django_db


def _permission(codename: str) -> Permission:
    return Permission.objects.get(codename=codename)


@pytest.fixture
def clerk() -> User:
    """In two groups (one with no permissions) and holding one permission directly."""
    user = User.objects.create_user(username="clerk", is_staff=True)
    books = Group.objects.create(name="books")
    books.permissions.add(_permission("view_refund"), _permission("view_ledgerentry"))
    user.groups.add(books, Group.objects.create(name="empty"))
    user.user_permissions.add(_permission("view_purchase"))
    return user


def _same_answers_as_django(user_id: int) -> None:
    loaded = StaffGrantsBackend().get_user(user_id)
    plain = ModelBackend().get_user(user_id)
    assert loaded is not None and plain is not None and loaded == plain
    with CaptureQueriesContext(connection) as queries:
        answers = (
            loaded.get_all_permissions(),
            loaded.get_user_permissions(),
            loaded.get_group_permissions(),
            loaded.has_perm("payments.view_refund"),
            loaded.has_perm("payments.change_refund"),
            loaded.has_module_perms("payments"),
            user_group_names(loaded),
        )
    expected = (
        plain.get_all_permissions(),
        plain.get_user_permissions(),
        plain.get_group_permissions(),
        plain.has_perm("payments.view_refund"),
        plain.has_perm("payments.change_refund"),
        plain.has_module_perms("payments"),
        frozenset(plain.groups.values_list("name", flat=True)),
    )
    assert answers == expected
    if not loaded.is_superuser:
        assert queries.captured_queries == []  # everything was read with the user


def test_a_staff_member_is_read_with_groups_and_permissions_in_one_query(clerk: User) -> None:
    with CaptureQueriesContext(connection) as queries:
        user = StaffGrantsBackend().get_user(clerk.pk)
    assert len(queries.captured_queries) == 1
    assert user is not None and user_group_names(user) == {"books", "empty"}
    assert user.get_all_permissions() == {
        "payments.view_refund",
        "payments.view_ledgerentry",
        "purchases.view_purchase",
    }
    _same_answers_as_django(clerk.pk)


def test_answers_match_django_for_every_kind_of_user(clerk: User) -> None:
    nobody = User.objects.create_user(username="nobody", is_staff=True)  # no group, no grant
    root = User.objects.create_superuser(username="root")
    for user in (clerk, nobody, root):
        _same_answers_as_django(user.pk)
    assert StaffGrantsBackend().get_user(root.pk).get_all_permissions() == {  # type: ignore[union-attr]
        f"{ct}.{name}"
        for ct, name in Permission.objects.values_list("content_type__app_label", "codename")
    }


def test_an_inactive_or_unknown_user_is_not_signed_in(clerk: User) -> None:
    User.objects.filter(pk=clerk.pk).update(is_active=False)
    assert StaffGrantsBackend().get_user(clerk.pk) is None
    assert StaffGrantsBackend().get_user(10**9) is None


def test_a_group_change_applies_on_the_next_request(clerk: User) -> None:
    """The grants are kept for one request only, as Django's own caches are."""
    client = Client()
    client.force_login(clerk)
    refunds = reverse("admin:payments_refund_changelist")
    assert client.get(refunds).status_code == 403  # no role group: the role table shows nothing
    clerk.groups.add(roles_ensure()["finance"])
    assert client.get(refunds).status_code == 200
    clerk.groups.clear()
    assert client.get(refunds).status_code == 403


def test_signing_in_with_a_password_goes_through_this_backend(clerk: User) -> None:
    clerk.set_password("correct horse battery")
    clerk.save()
    client = Client()
    signed_in = client.post(
        reverse("admin:login"), {"username": "clerk", "password": "correct horse battery"}
    )
    assert signed_in.status_code == 302
    assert client.session["_auth_user_backend"] == "core.auth.StaffGrantsBackend"
    assert client.get(reverse("admin:index")).status_code == 200
