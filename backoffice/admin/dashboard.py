"""The back-office dashboard: one page of the figures support and finance check first,
with a server-rendered SVG chart (no script, no CDN)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone

from backoffice.books import BooksDay, books_daily
from core.clock import utc_seconds
from purchases.selectors import OUTCOMES, dashboard_figures

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


MONEY_COLOURS = {"revenue": "#417505", "refunds": "#ba2121", "gas": "#e8a317"}
PANEL_HEIGHT, PANEL_GAP, DAY_WIDTH = 100, 34, 36


def money_chart(days: list[BooksDay]) -> dict[str, Any]:
    """Revenue and refunds per day (one panel per asset symbol, the two bars side by side on
    one scale) and the relayer's gas per day (one panel per native coin: another unit, so
    another scale). Rectangles with coordinates for the template's <svg>."""
    symbols = sorted({s for day in days for s in (*day.revenue, *day.refunds)})
    coins = sorted({c for day in days for c in day.gas})
    panels = [_panel(days, symbol, ("revenue", "refunds")) for symbol in symbols]
    panels += [_panel(days, coin, ("gas",)) for coin in coins]
    for index, panel in enumerate(panels):
        panel["top"] = index * (PANEL_HEIGHT + PANEL_GAP)
        panel["base"] = panel["top"] + PANEL_HEIGHT + 14
        for bar in panel["bars"]:
            bar["y"] += panel["top"] + 14
    return {
        "panels": panels,
        "width": max(len(days) * DAY_WIDTH, 200),
        "height": max(len(panels), 1) * (PANEL_HEIGHT + PANEL_GAP),
        "days": [{"x": i * DAY_WIDTH, "label": f"{d.day:%m-%d}"} for i, d in enumerate(days)],
        "legend": list(MONEY_COLOURS.items()),
    }


def _panel(days: list[BooksDay], unit: str, series: tuple[str, ...]) -> dict[str, Any]:
    def value(day: BooksDay, name: str) -> Decimal:
        return getattr(day, name).get(unit, Decimal(0))

    tallest = max([value(day, name) for day in days for name in series] + [Decimal(0)])
    width = (DAY_WIDTH - 8) // len(series)
    bars = []
    for index, day in enumerate(days):
        for offset, name in enumerate(series):
            amount = value(day, name)
            height = round(amount * PANEL_HEIGHT / tallest) if tallest else 0
            bars.append({"x": index * DAY_WIDTH + offset * width, "y": PANEL_HEIGHT - height,
                         "width": width, "height": height, "series": name,
                         "colour": MONEY_COLOURS[name], "day": f"{day.day:%Y-%m-%d}",
                         "value": f"{amount.normalize():f}"})  # fmt: skip
    title = f"{' and '.join(series)} per day ({unit}), max {tallest.normalize():f}"
    return {"unit": unit, "title": title, "bars": bars}


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
        "money": money_chart(books_daily(now=now)),
        "now": utc_seconds(now),
    }
    return TemplateResponse(request, "admin/purchases/dashboard.html", context)
