"""Admin bases every app's admin uses: evidence is read, never edited here."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import flatten_fieldsets
from django.core.paginator import Paginator
from django.http import HttpRequest
from django.utils.functional import cached_property


def amount_human(amount: int, decimals: int) -> Decimal:
    """Atomic units to asset units, exactly (never float): 250000 at 6 is Decimal("0.250000")."""
    return Decimal(amount).scaleb(-decimals)


def _all_fields_read_only(model_admin: Any) -> list[str]:
    # Non-editable fields (created_at, refs) only render when listed as read-only.
    if model_admin.fieldsets:
        return list(flatten_fieldsets(model_admin.fieldsets))
    if model_admin.fields:
        return [*model_admin.fields, *model_admin.readonly_fields]
    names = [f.name for f in model_admin.model._meta.fields if not f.primary_key]
    return [*names, *model_admin.readonly_fields]


class ReadOnlyModelAdmin(admin.ModelAdmin):
    """Evidence is looked at, never edited: records change only through services."""

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return _all_fields_read_only(self)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReadOnlyInline(admin.TabularInline):
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
