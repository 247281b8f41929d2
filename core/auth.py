"""Staff authentication: a signed-in user is read with their group names and permissions,
in one query per request.

The admin asks on every page which groups a staff member is in (the role table, see
core.admin) and which Django permissions they hold (ModelBackend reads the user's own and
their groups' permissions in two more queries): three reads a superuser never costs, on a
page budgeted at ten. Read with the user in the session's authentication step instead, a
role's page costs what a superuser's does. The answers are the same: this is Django's
ModelBackend with its per-request caches filled up front.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.db.models import CharField, F, Value

# Where the group names are kept on the user for the request (read by user_group_names).
GROUP_NAMES = "_group_names_cache"


def user_group_names(user: Any) -> frozenset[str]:
    """The names of the groups the user is in: loaded with the user by StaffGrantsBackend,
    else read once and kept on the user for the rest of the request."""
    if not getattr(user, "is_authenticated", False):
        return frozenset()
    names = getattr(user, GROUP_NAMES, None)
    if names is None:
        names = frozenset(user.groups.values_list("name", flat=True))
        setattr(user, GROUP_NAMES, names)
    return names


class StaffGrantsBackend(ModelBackend):
    """ModelBackend whose get_user also reads the user's groups and permissions."""

    def get_user(self, user_id: Any) -> Any:
        user_model = get_user_model()
        this_user = user_model._default_manager.filter(pk=user_id)
        # One row per grant, each carrying the user's columns: a group with each of its
        # permissions (the outer joins give a group with none, or no group, one row), then
        # each permission granted to the user directly.
        via_groups = this_user.annotate(
            grant_group=F("groups__name"),
            grant_app=F("groups__permissions__content_type__app_label"),
            grant_codename=F("groups__permissions__codename"),
            grant_is_direct=Value(False),
        )
        direct = this_user.annotate(
            grant_group=Value(None, output_field=CharField()),
            grant_app=F("user_permissions__content_type__app_label"),
            grant_codename=F("user_permissions__codename"),
            grant_is_direct=Value(True),
        )
        rows = list(via_groups.union(direct, all=True))
        if not rows:
            return None
        user = rows[0]
        if not self.user_can_authenticate(user):
            return None
        _cache_grants(user, rows)
        return user


def _cache_grants(user: Any, rows: list[Any]) -> None:
    """Fill the caches ModelBackend would fill on the first permission check (the same
    attribute names), and the group names."""
    setattr(user, GROUP_NAMES, frozenset(r.grant_group for r in rows if r.grant_group))
    if user.is_superuser:
        return  # Django answers a superuser's permissions itself (all of them)
    granted = [r for r in rows if r.grant_codename]
    own = {f"{r.grant_app}.{r.grant_codename}" for r in granted if r.grant_is_direct}
    via_groups = {f"{r.grant_app}.{r.grant_codename}" for r in granted if not r.grant_is_direct}
    user._user_perm_cache = own
    user._group_perm_cache = via_groups
    user._perm_cache = own | via_groups
