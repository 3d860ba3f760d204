"""Bar charts of daily credit, laid out here and drawn as inline SVG by a template, so pages need no JavaScript."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .summaries import Day

WIDTH = 300  # viewBox units; the CSS stretches the chart to its card
HEIGHT = 100
GAP = 0.2  # the part of each day's slot left empty between bars
MIN_VISIBLE = 1.0  # a day with any credit shows at least this tall, however small next to the best day


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    title: str  # the date and the credit: what a pointer or a screen reader's graphic mode gets


@dataclass(frozen=True)
class BarChart:
    width: int
    height: int
    bars: list[Bar]
    label: str  # the whole chart in one sentence, for aria-label
    first: str  # the first and last day, printed under the chart
    last: str
    top: str = ""  # the value of the chart's top (the best day), printed beside it as its y-axis; "" when empty

    @property
    def empty(self) -> bool:
        """No credit on any day: the page says so instead of drawing an empty box."""
        return not self.top


def daily_credit(days: Sequence[Day]) -> BarChart:
    """One bar per day, scaled to the best day; days without credit keep their (empty) place."""
    if not days:
        raise ValueError("a daily credit chart needs at least one day; pass the summary's days, zero-filled")
    slot = WIDTH / len(days)
    top = max(d.credit for d in days)
    bars = []
    for i, d in enumerate(days):
        height = 0.0
        if d.credit > 0 and top > 0:
            height = max(MIN_VISIBLE, HEIGHT * d.credit / top)
        bars.append(
            Bar(
                x=round(i * slot + slot * GAP / 2, 3),
                y=round(HEIGHT - height, 3),
                width=round(slot * (1 - GAP), 3),
                height=round(height, 3),
                title=f"{_long(d)}: {d.credit:,.3f} credit",
            )
        )
    best = max(days, key=lambda d: d.credit)
    summary = (
        f"most on {_long(best)}, {best.credit:,.3f} credit" if best.credit > 0 else "no credit on any of these days"
    )
    label = f"Daily credit for the last {len(days)} days, {_long(days[0])} to {_long(days[-1])}: {summary}."
    top_text = f"{top:,.3g} credit" if top > 0 else ""
    return BarChart(WIDTH, HEIGHT, bars, label, _short(days[0]), _short(days[-1]), top_text)


def _long(d: Day) -> str:
    return f"{d.day:%b} {d.day.day}, {d.day.year}"


def _short(d: Day) -> str:
    return f"{d.day:%b} {d.day.day}"
