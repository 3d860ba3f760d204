"""A campaign's progress as one rich panel: step bar, loss trend, throughput, agents (the demo's view)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 40) -> str:
    """The last ``width`` values as block characters, scaled between their own min and max."""
    tail = [v for v in values[-width:] if math.isfinite(v)]
    if not tail:
        return ""
    low, high = min(tail), max(tail)
    span = high - low or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - low) / span * len(SPARK)))] for v in tail)


@dataclass(frozen=True)
class ProgressView:
    """What the panel shows, taken from the site's ``/api/campaigns/<id>/progress`` and the launcher."""

    site_url: str
    progress: dict[str, Any]
    max_steps: int | None
    agents_running: int
    elapsed_s: float
    note: str = ""

    def loss_text(self) -> Text:
        losses = self.progress.get("losses") or []
        if not losses:
            return Text("waiting for the first step", style="dim")
        text = Text(f"{losses[0]:.3f} → ", style="bold")
        text.append(f"{losses[-1]:.3f}", style="bold green" if losses[-1] < losses[0] else "bold yellow")
        text.append("   ")
        text.append(sparkline(losses), style="cyan")
        return text

    def render(self) -> RenderableType:
        p = self.progress
        applied = int(p.get("version", 0))
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim", justify="right")
        grid.add_column()
        if self.max_steps:
            bar = Table.grid(padding=(0, 1))
            bar.add_row(
                Text(f"{applied}/{self.max_steps}", style="bold"),
                ProgressBar(total=self.max_steps, completed=min(applied, self.max_steps), width=40),
            )
            grid.add_row("step", bar)
        else:
            grid.add_row("step", Text(f"{applied}  (runs until Ctrl-C)", style="bold"))
        grid.add_row("loss", self.loss_text())
        grid.add_row("samples/s", f"{p.get('samples_per_s', 0.0):.1f}   ({p.get('samples', 0)} samples so far)")
        grid.add_row(
            "agents",
            f"{self.agents_running} running, {p.get('active_leases', 0)} leases out, "
            f"{p.get('contributors', 0)} volunteers credited",
        )
        minutes, seconds = divmod(int(self.elapsed_s), 60)
        grid.add_row("state", f"{p.get('state', '?')}   elapsed {minutes}:{seconds:02d}")
        grid.add_row("site", Text(f"{self.site_url}/", style="underline"))
        parts: list[RenderableType] = [grid]
        if self.note:
            parts.append(Text(self.note, style="dim"))
        return Panel(Group(*parts), title=f"Crowdtrain demo: {p.get('name', 'campaign')}", border_style="blue")
