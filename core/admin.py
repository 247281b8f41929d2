"""Admin bases every app's admin uses: evidence is read, never edited here, and each staff
role sees only the fields its job needs.

The role table (which role sees which fields and may run which actions, per model) is data
owned by the top floor (`backoffice.roles`) and installed here at start-up, so this kernel
names no app. `RoleScopedAdmin` applies it to every page an admin renders: the change page,
the list, its search, its filters, its actions and its inlines. A hidden field is absent,
not read-only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import flatten_fieldsets
from django.core.exceptions import ImproperlyConfigured, PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Case, IntegerField, Model, Value, When
from django.db.models.expressions import OrderBy
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.utils.functional import cached_property

from core.auth import user_group_names
from core.clock import utc_seconds


def amount_human(amount: int, decimals: int) -> Decimal:
    """Atomic units to asset units, exactly (never float): 250000 at 6 is Decimal("0.250000")."""
    return Decimal(amount).scaleb(-decimals)


# --- the role table -----------------------------------------------------------------------
@dataclass(frozen=True)
class RoleScope:
    """What one role sees of one model: field names (model fields, admin display names and
    the search paths it may search by) and the admin actions it may run."""

    fields: frozenset[str]
    actions: frozenset[str] = field(default_factory=frozenset)


# role name (a Group name) -> model label ("payments.refund") -> scope
RoleTable = Mapping[str, Mapping[str, RoleScope]]
# model label -> names nobody sees in the admin, superusers included (key material)
NeverShown = Mapping[str, frozenset[str]]


@dataclass
class _Installed:
    table: RoleTable | None = None
    never_shown: NeverShown = field(default_factory=dict)


_installed = _Installed()


def role_table_install(table: RoleTable, never_shown: NeverShown) -> None:
    """Called once at start-up by the app that owns the roles (AppConfig.ready)."""
    _installed.table = table
    _installed.never_shown = never_shown


def _table() -> RoleTable:
    if _installed.table is None:
        # Failing closed: without the table nobody but a superuser would see anything.
        raise ImproperlyConfigured("no admin role table installed (role_table_install)")
    return _installed.table


def _user_roles(request: HttpRequest) -> frozenset[str]:
    # Read with the user when they signed in through core.auth.StaffGrantsBackend.
    return user_group_names(request.user)


def _path(entry: str) -> str:
    return entry.lstrip("=^@")  # a search prefix ("=ref") names the same field


def _filter_name(entry: Any) -> str:
    if isinstance(entry, (list, tuple)):
        entry = entry[0]
    if isinstance(entry, str):
        return entry.split("__")[0]
    return str(getattr(entry, "parameter_name", None) or getattr(entry, "field_path", ""))


class RoleScoping:
    """The answer to "may this request see field X / run action Y of this model"."""

    def __init__(self, request: HttpRequest, model: type[Model]) -> None:
        label = model._meta.label_lower
        self.never = _installed.never_shown.get(label, frozenset())
        self.is_superuser = bool(getattr(request.user, "is_superuser", False))
        scopes = [] if self.is_superuser else _scopes_of(request, label)
        self.has_scope = self.is_superuser or bool(scopes)
        # A person in two groups sees what either role sees (as Django unions permissions).
        self.fields = frozenset().union(*(s.fields for s in scopes))
        self.actions = frozenset().union(*(s.actions for s in scopes))

    def sees(self, name: str) -> bool:
        name = _path(name)
        if name in self.never or name.split("__")[-1] in self.never:
            return False
        return self.is_superuser or name in self.fields

    def may_run(self, action: str) -> bool:
        return self.is_superuser or action in self.actions


def _scopes_of(request: HttpRequest, label: str) -> list[RoleScope]:
    table = _table()
    return [
        table[role][label] for role in sorted(_user_roles(request)) if label in table.get(role, {})
    ]


def role_scoping(request: HttpRequest, model: type[Model]) -> RoleScoping:
    return RoleScoping(request, model)


def _keep(names: Iterable[Any], scoping: RoleScoping) -> list[Any]:
    return [n for n in names if isinstance(n, str) and scoping.sees(n)]


class RoleScopedAdmin:
    """Mixin for every ModelAdmin and inline: the role table decides what is on the page.

    Everything an admin shows passes through here (fields, fieldsets, list columns, search
    paths, filters, URL lookups, actions, inlines), so a field hidden from a role cannot be
    read, searched or filtered by; an action not granted is neither offered nor run (403).
    """

    model: type[Model]

    def role_scoping(self, request: HttpRequest) -> RoleScoping:
        return role_scoping(request, self.model)

    def role_allows_action(self, request: HttpRequest, action: str) -> bool:
        return self.role_scoping(request).may_run(action)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self.role_scoping(request).has_scope and super().has_view_permission(  # type: ignore[misc]
            request, obj
        )

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[Any]:
        return _keep(super().get_fields(request, obj), self.role_scoping(request))  # type: ignore[misc]

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> list[Any]:
        scoping = self.role_scoping(request)
        kept = []
        for title, options in super().get_fieldsets(request, obj):  # type: ignore[misc]
            names = _keep(flatten_fieldsets([(title, options)]), scoping)
            if names:
                kept.append((title, {**options, "fields": names}))
        return kept

    def get_list_display(self, request: HttpRequest) -> list[Any]:
        kept = _keep(super().get_list_display(request), self.role_scoping(request))  # type: ignore[misc]
        return kept or ["pk"]

    def get_list_display_links(self, request: HttpRequest, list_display: Sequence[Any]) -> Any:
        links = super().get_list_display_links(request, list_display)  # type: ignore[misc]
        kept = [name for name in links or () if name in list_display]
        return kept or list(list_display[:1])

    def get_search_fields(self, request: HttpRequest) -> list[str]:
        return _keep(super().get_search_fields(request), self.role_scoping(request))  # type: ignore[misc]

    def get_list_filter(self, request: HttpRequest) -> list[Any]:
        scoping = self.role_scoping(request)
        return [f for f in super().get_list_filter(request) if scoping.sees(_filter_name(f))]  # type: ignore[misc]

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        # Django allows any local-field lookup in the URL; a hidden field must not be a
        # filter (an oracle for its value) even when typed by hand.
        if request is not None and not self.role_scoping(request).sees(lookup.split("__")[0]):
            return False
        return bool(super().lookup_allowed(lookup, value, request))  # type: ignore[misc]

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        scoping = self.role_scoping(request)
        actions = super().get_actions(request)  # type: ignore[misc]
        return {name: a for name, a in actions.items() if scoping.may_run(name)}

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # Django answers an action it does not offer with "No action selected"; a posted
        # action the role may not run is a forged request, so it is refused outright.
        posted = request.POST.getlist("action") if request.method == "POST" else []
        offered = self.get_actions(request)
        if any(n in self._declared_actions() and n not in offered for n in posted):
            raise PermissionDenied
        return super().changelist_view(request, extra_context)  # type: ignore[misc,no-any-return]

    def _declared_actions(self) -> set[str]:
        site_actions = {name for name, _ in self.admin_site.actions}  # type: ignore[attr-defined]
        own = {a if isinstance(a, str) else a.__name__ for a in getattr(self, "actions", ()) or ()}
        return site_actions | own


def _all_fields_read_only(model_admin: Any) -> list[str]:
    # Non-editable fields (created_at, refs) only render when listed as read-only.
    if model_admin.fieldsets:
        return list(flatten_fieldsets(model_admin.fieldsets))
    if model_admin.fields:
        return [*model_admin.fields, *model_admin.readonly_fields]
    names = [f.name for f in model_admin.model._meta.fields if not f.primary_key]
    return [*names, *model_admin.readonly_fields]


class ReadOnlyModelAdmin(RoleScopedAdmin, admin.ModelAdmin):
    """Evidence is looked at, never edited: records change only through services."""

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return _all_fields_read_only(self)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReadOnlyInline(RoleScopedAdmin, admin.TabularInline):
    extra = 0
    can_delete = False
    show_change_link = True

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return _all_fields_read_only(self)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class CappedCountPaginator(Paginator):
    """Counts at most COUNT_CAP + 1 rows: a list over a million rows pages in milliseconds.

    Past the cap the list says COUNT_CAP + 1 and offers that many pages; support narrows
    with a filter or an exact search instead of paging that deep.
    """

    COUNT_CAP = 10_000

    @cached_property
    def count(self) -> int:
        query: Any = self.object_list
        if not hasattr(query, "query"):  # a plain list
            return len(query)
        # SELECT COUNT(*) FROM (SELECT id ... LIMIT cap + 1): stops reading at the cap.
        return int(query.order_by().values("pk")[: self.COUNT_CAP + 1].count())


class DueFirstQueue:
    """A queue staff work through (escalations, refund requests): open items first, the
    nearest deadline next, so the top of the list is what is due; each with its deadline in
    UTC and whether it is overdue. The model has `state`, `deadline_at` and an open state."""

    open_state: str

    def get_ordering(self, request: HttpRequest) -> list[Any]:
        is_closed = Case(
            When(state=self.open_state, then=Value(0)),
            default=Value(1),
            output_field=IntegerField(),
        )
        return [OrderBy(is_closed), "deadline_at", "pk"]

    @admin.display(description="deadline (UTC)", ordering="deadline_at")
    def deadline_utc(self, obj: Any) -> str:
        return utc_seconds(obj.deadline_at)

    @admin.display(boolean=True, description="overdue")
    def is_overdue(self, obj: Any) -> bool:
        return bool(obj.state == self.open_state and obj.deadline_at < timezone.now())
