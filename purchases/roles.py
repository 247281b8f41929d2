"""The staff roles, as code: groups with exactly the model permissions each job needs."""

from __future__ import annotations

from django.contrib.auth.models import Group, Permission
from django.db import transaction
from django.db.models import Q

STAFF_APPS = ("purchases", "payments", "fulfillment")

FINANCE_PERMISSIONS = (
    ("payments", "view_refund"),
    ("payments", "change_refund"),  # "Mark paid back" rides on this
    ("payments", "view_ledgerentry"),
    ("payments", "add_ledgerentry"),  # "Top up a balance" rides on this
    ("purchases", "view_purchase"),
    # A refund is explained from its purchase's timeline and the payment it returns.
    ("purchases", "view_purchaseevent"),
    ("payments", "view_paymentattempt"),
    ("payments", "approve_refund"),  # a refund support proposes is owed only once approved
)

SUPPORT_EXTRA_PERMISSIONS = (
    ("purchases", "change_escalation"),  # "Resolve" and "Assign or escalate" ride on this
    ("purchases", "act_on_purchase"),  # re-check, reconcile, redeliver, propose a refund
)


def _permissions(pairs: tuple[tuple[str, str], ...]) -> list[Permission]:
    query = Q()
    for app_label, codename in pairs:
        query |= Q(content_type__app_label=app_label, codename=codename)
    found = list(Permission.objects.filter(query).select_related("content_type"))
    missing = set(pairs) - {(p.content_type.app_label, p.codename) for p in found}
    if missing:
        # Permissions are created by migrate; running before it would build a silent half-role.
        raise LookupError(f"permissions not found (run migrate first): {sorted(missing)}")
    return found


def _view_everything() -> tuple[tuple[str, str], ...]:
    views = Permission.objects.filter(
        content_type__app_label__in=STAFF_APPS, codename__startswith="view_"
    ).values_list("content_type__app_label", "codename")
    return tuple(sorted(views))


@transaction.atomic
def roles_ensure() -> dict[str, Group]:
    """Create or reset the "support" and "finance" groups. Idempotent.

    Each group ends with exactly the permissions below: a permission granted by hand in
    the admin is removed on the next run, so the roles stay what this file says.
    Raises LookupError when run before migrate created the permissions.
    """
    wanted = {
        "support": _view_everything() + SUPPORT_EXTRA_PERMISSIONS,
        "finance": FINANCE_PERMISSIONS,
    }
    groups = {}
    for name, pairs in wanted.items():
        group, _ = Group.objects.get_or_create(name=name)
        group.permissions.set(_permissions(pairs))
        groups[name] = group
    return groups
