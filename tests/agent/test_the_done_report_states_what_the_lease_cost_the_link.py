"""Each done report states what its lease cost the link: its own upload bytes exactly, and the downloads
and network waits since the report before it, so a run's reports add up to everything the link carried."""

from __future__ import annotations

import pytest

from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.netmeter import NetworkMeter
from crowdtrain_agent.protocol import LeaseDone
from crowdtrain_agent.runtime import Agent

from .conftest import FAST_BACKOFF
from .fakes import World


@pytest.fixture
def meter(monkeypatch: pytest.MonkeyPatch) -> NetworkMeter:
    fresh = NetworkMeter()  # not the process's: other tests' transfers must not count here
    for module in ("crowdtrain_agent.fetch", "crowdtrain_agent.uploader", "crowdtrain_agent.runtime"):
        monkeypatch.setattr(f"{module}.METER", fresh)
    return fresh


async def test_a_done_report_carries_the_bytes_its_aggregators_received(
    world: World, config: AgentConfig, meter: NetworkMeter
) -> None:
    world.site.replies = [world.lease(1, [(0, 10), (20, 6)], microbatch=4), world.lease(2, [(10, 7)], codec="fp16")]

    assert await Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01).run() == 0

    done = world.site.of_kind(LeaseDone)
    assert [d.lease_id for d in done] == [1, 2]
    for report in done:
        received = sum(agg.upload_bytes[report.lease_id] for agg in world.aggregators)
        assert report.bytes_up == received
    params = world.params.numel()
    assert 4 * params <= done[0].bytes_up < 4 * params + 1024  # fp32: the gradient and a few chunk headers
    assert 2 * params <= done[1].bytes_up < 2 * params + 1024  # fp16: half of it


async def test_the_reports_add_up_to_every_download_and_wait_of_the_run(
    world: World, config: AgentConfig, meter: NetworkMeter
) -> None:
    world.site.replies = [world.lease(1, [(0, 10), (20, 6)]), world.lease(2, [(10, 7)])]

    await Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01).run()

    done = world.site.of_kind(LeaseDone)
    # The first lease paid for the parameters and the shard; the second found both in hand.
    assert done[0].bytes_down >= 4 * world.params.numel() + len(world.shard)
    assert sum(d.bytes_down for d in done) == meter.bytes_down
    assert sum(d.bytes_up for d in done) == meter.bytes_up
    assert sum(d.network_s for d in done) == pytest.approx(meter.waited_s, abs=1e-5)
    assert all(d.network_s >= 0.0 for d in done)


def test_each_share_is_taken_once() -> None:
    meter = NetworkMeter()
    meter.received(1000)
    meter.waited(0.5)

    first = meter.unreported()
    meter.received(200)
    second = meter.unreported()
    third = meter.unreported()

    assert first == (1000, 0.5)
    assert second == (200, 0.0)
    assert third == (0, 0.0)
