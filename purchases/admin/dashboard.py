"""The back-office dashboard: one page of the figures support and finance check first,
with a server-rendered SVG chart (no script, no CDN)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone

from purchases.selectors import OUTCOMES, dashboard_figures
from purchases.timeline import utc_seconds

OUTCOME_COLOURS = {
    "done": "#417505",
    "in_progress": "#79aec8",
    "payment_failed": "#999999",
    "work_failed": "#ba2121",
    "work_unknown": "#e8a317",
}
BAR_WIDTH, GAP, HEIGHT = 28, 8, 160


def outcome_chart(chart: list[tuple[Any, dict[str, int]]]) -> dict[str, Any]:
    """Stacked bars, one per day: rectangles with coordinates for the template's <svg>."""
    tallest = max([sum(counts.values()) for _, counts in chart] + [1])
    bars = []
    for index, (day, counts) in enumerate(chart):
        x, y = index * (BAR_WIDTH + GAP), HEIGHT
        rects = []
        for outcome in OUTCOMES:
            height = round(counts[outcome] * HEIGHT / tallest)
            if height:
                y -= height
                rects.append(
                    {"y": y, "height": height, "colour": OUTCOME_COLOURS[outcome],
                     "title": f"{day}: {counts[outcome]} {outcome}"}
                )  # fmt: skip
        bars.append({"x": x, "day": day, "total": sum(counts.values()), "rects": rects})
    return {
        "bars": bars,
        "width": len(chart) * (BAR_WIDTH + GAP),
        "height": HEIGHT,
        "bar_width": BAR_WIDTH,
        "legend": [(o, OUTCOME_COLOURS[o]) for o in OUTCOMES],
    }


def dashboard_view(model_admin: Any, request: HttpRequest) -> HttpResponse:
    if not model_admin.has_view_permission(request):
        raise PermissionDenied
    now = timezone.now()
    figures = dashboard_figures(now=now)
    oldest = figures["oldest_pending"]
    context = {
        **model_admin.admin_site.each_context(request),
        "title": "Dashboard",
        "opts": model_admin.opts,
        "figures": figures,
        "oldest_pending_since": utc_seconds(oldest.created_at) if oldest else "",
        "overdue": [
            {"escalation": e, "deadline": utc_seconds(e.deadline_at)}
            for e in figures["overdue_escalations"]
        ],
        "chart": outcome_chart(figures["chart"]),
        "now": utc_seconds(now),
    }
    return TemplateResponse(request, "admin/purchases/dashboard.html", context)
