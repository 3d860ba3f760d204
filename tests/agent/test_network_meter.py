"""The agent tells a slow link from a slow GPU: upload and download rates, and the share of time it waited on them."""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.netmeter import NetworkMeter, describe
from crowdtrain_agent.progress import AgentStatus, render_status
from crowdtrain_agent.runtime import Agent

from .conftest import FAST_BACKOFF
from .fakes import World


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rates_average_the_recent_window_and_forget_older_transfers() -> None:
    clock = Clock()
    meter = NetworkMeter(window_s=30.0, clock=clock)
    for _ in range(30):  # 250 kB up and 1 MB down every second for 30 s
        meter.sent(250_000)
        meter.received(1_000_000)
        clock.now += 1.0

    figures = meter.figures()
    assert figures.up_bytes_per_s == pytest.approx(250_000, rel=0.05)
    assert figures.down_bytes_per_s == pytest.approx(1_000_000, rel=0.05)
    assert describe(figures).startswith("up 2.0 Mbit/s, down 8.0 Mbit/s")

    clock.now += 31.0  # a quiet link: the window empties, the totals stay
    figures = meter.figures()
    assert (figures.up_bytes_per_s, figures.down_bytes_per_s) == (0.0, 0.0)
    assert (figures.bytes_up, figures.bytes_down) == (30 * 250_000, 30 * 1_000_000)


@given(waits=st.lists(st.floats(min_value=0.0, max_value=5.0), max_size=20), idle=st.floats(0.0, 100.0))
def test_the_wait_share_is_the_time_waited_over_the_time_worked(waits: list[float], idle: float) -> None:
    clock = Clock()
    meter = NetworkMeter(clock=clock)
    meter.start_working()
    for wait in waits:
        meter.waited(wait)
        clock.now += wait
    clock.now += idle  # computing, or waiting for the site to hand out work: not the link's fault
    elapsed = sum(waits) + idle

    share = meter.figures().wait_share

    if elapsed < 1.0:
        assert share is None  # too early to say
    else:
        assert share == pytest.approx(sum(waits) / elapsed)
        assert 0.0 <= share <= 1.0


def test_the_panel_has_a_network_line() -> None:
    clock = Clock()
    meter = NetworkMeter(clock=clock)
    meter.start_working()
    meter.received(5_000_000)
    meter.waited(3.0)
    clock.now += 10.0
    console = Console(record=True, width=120, file=io.StringIO())

    console.print(render_status(AgentStatus(network=meter)))

    assert "waited on the network 30% of the time" in console.export_text()


async def test_a_run_counts_the_bytes_it_uploads_and_downloads(
    world: World, config: AgentConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    meter = NetworkMeter()
    for module in ("crowdtrain_agent.fetch", "crowdtrain_agent.uploader", "crowdtrain_agent.runtime"):
        monkeypatch.setattr(f"{module}.METER", meter)
    world.site.replies = [world.lease(1, [(0, 10), (20, 6)], microbatch=4), world.lease(2, [(10, 7)], microbatch=3)]
    agent = Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01)

    assert await agent.run() == 0

    figures = meter.figures()
    # Its gradient went up as fp32 (4 bytes per parameter), and the parameters and shards came down.
    uploaded = sum(t.numel() for t in (u for a in world.aggregators for u in a.uploads.values()))
    assert 4 * uploaded <= figures.bytes_up <= 4 * uploaded + 64 * len(world.aggregators) * 2  # + chunk headers
    assert figures.bytes_down >= 4 * uploaded // 2  # one lease's parameters at least, and its shards
    assert agent.status.network is meter  # the panel reads the meter the transfers count in
