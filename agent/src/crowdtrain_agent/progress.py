"""What the volunteer sees: a rich live panel on a terminal, plain log lines otherwise."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType

from rich.console import Console, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from .netmeter import NetworkMeter, describe


@dataclass
class AgentStatus:
    """The agent's state as the display shows it; written by the runtime on the event loop."""

    device: str = ""
    campaign_id: int | None = None
    version: int | None = None
    lease_id: int | None = None
    samples_per_s: float | None = None
    last_loss: float | None = None  # mean loss per sample of the last finished lease
    published_loss: float | None = None  # loss the site reported with the latest version
    accepted: int = 0
    rejected: int = 0
    credit: float = 0.0  # earned by accepted leases, granted when their steps commit
    status: str = "starting"
    status_since: float = field(default_factory=time.monotonic)
    network: NetworkMeter | None = None  # the link's rates and the time waited on it (``netmeter``)
    # How the device meets its memory wall (``trainer.compute_gradient``): out-of-memory errors recovered
    # from, and what they and the measured peak left: the samples per microbatch, checkpointing, precision.
    out_of_memory: int = 0
    memory: str = ""

    def set_status(self, text: str) -> None:
        """Change the status line; the panel shows how long it has held, so waits are visible."""
        if text != self.status:
            self.status = text
            self.status_since = time.monotonic()


def _fmt(value: float | int | None, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def render_status(status: AgentStatus) -> RenderableType:
    """The live panel: one row per fact, the status line last."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold cyan", justify="right")
    table.add_column()
    table.add_row("device", status.device or "-")
    table.add_row("campaign", _fmt(status.campaign_id))
    table.add_row("version", _fmt(status.version))
    table.add_row("lease", _fmt(status.lease_id))
    table.add_row("samples/s", _fmt(status.samples_per_s, ".1f"))
    table.add_row("last loss", _fmt(status.last_loss, ".4f"))
    table.add_row("leases", f"{status.accepted} accepted, {status.rejected} not counted")
    table.add_row("credit", f"{status.credit:,.1f} (1 credit = 1 GFLOP of accepted work, granted as steps commit)")
    if status.network is not None:
        table.add_row("network", describe(status.network.figures()))
    if status.memory or status.out_of_memory:
        recovered = f"; {status.out_of_memory} out-of-memory error(s) recovered" if status.out_of_memory else ""
        table.add_row("memory", f"{status.memory or 'as the campaign asks'}{recovered}")
    waited = time.monotonic() - status.status_since
    table.add_row("status", f"{status.status} ({waited:.0f} s)" if waited >= 2 else status.status)
    return Panel(table, title="crowdtrain-agent", subtitle="Ctrl-C: finish this lease and stop", expand=False)


class LiveProgress:
    """Context manager showing AgentStatus in a panel redrawn twice a second."""

    def __init__(self, status: AgentStatus, console: Console) -> None:
        self._live = Live(get_renderable=lambda: render_status(status), console=console, refresh_per_second=2)

    def __enter__(self) -> LiveProgress:
        self._live.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._live.stop()
