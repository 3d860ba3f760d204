"""A lease over several shards starts computing on its first range while its later shards download."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import msgspec
import pytest
import torch

from crowdtrain_agent import runtime, trainer
from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.data import sha256_hex
from crowdtrain_agent.protocol import Lease, LeaseDone, LeaseRelease, SampleRange
from crowdtrain_agent.runtime import Agent
from tests.shards import make_tensor_shards

from .conftest import FAST_BACKOFF
from .fakes import World


def _second_shard(world: World) -> str:
    """Rows 20..39 of the world's samples as a shard of their own; its name."""
    ((shard, _),) = list(make_tensor_shards(world.x[20:].numpy(), world.y[20:].numpy(), 20))
    sha = sha256_hex(shard)
    world.site.shards[sha] = shard
    return sha


def _two_shard_lease(world: World, lease_id: int, second: str) -> Lease:
    lease = world.lease(lease_id, [(0, 8), (20, 8)], microbatch=4)
    ranges = [SampleRange(shard=world.sha, start=0, count=8), SampleRange(shard=second, start=0, count=8)]
    return msgspec.structs.replace(lease, ranges=ranges)


async def test_the_first_microbatches_run_before_the_second_shard_has_come(
    world: World, config: AgentConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    second = _second_shard(world)
    arrived = world.site.held_shards[second] = asyncio.Event()
    world.site.replies = [_two_shard_lease(world, 1, second)]
    waits: list[tuple[int, int]] = []  # (rows a microbatch needs, rows there), as the compute asked
    blocked = threading.Event()
    wait = trainer.ArrivingSamples.wait

    def watched(self: trainer.ArrivingSamples, rows: int, cancel: threading.Event | None = None) -> None:
        waits.append((rows, self.filled))
        if rows > self.filled:
            blocked.set()
        wait(self, rows, cancel)

    monkeypatch.setattr(trainer.ArrivingSamples, "wait", watched)
    run = asyncio.create_task(Agent(replace(config, max_leases=1), backoff=FAST_BACKOFF, benchmark_s=0.01).run())

    for _ in range(200):
        if blocked.is_set():
            break
        await asyncio.sleep(0.05)
    computed_before = list(waits)
    arrived.set()
    code = await asyncio.wait_for(run, 30)

    # Two microbatches of the first shard's rows, then the compute waited for the second shard's.
    assert computed_before[:3] == [(4, 8), (8, 8), (12, 8)], computed_before
    assert code == 0
    uploaded = torch.cat([world.aggregators[0].uploads[(1, 0)], world.aggregators[1].uploads[(1, 1)]])
    torch.testing.assert_close(uploaded, world.expected_gradient([(0, 8), (20, 8)]))
    assert [d.lease_id for d in world.site.of_kind(LeaseDone)] == [1]


async def test_a_later_shard_that_cannot_be_had_gives_the_lease_back_and_work_goes_on(
    world: World, config: AgentConfig, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime, "LEASE_ERROR_PAUSE_S", 0.01)
    missing = "0" * 64
    world.site.replies = [_two_shard_lease(world, 1, missing), world.lease(2, [(0, 4)])]

    agent = Agent(replace(config, max_leases=2), backoff=FAST_BACKOFF, benchmark_s=0.01)
    code = await asyncio.wait_for(agent.run(), 30)

    assert code == 0
    assert world.site.of_kind(LeaseRelease) == [LeaseRelease(lease_id=1)]
    assert [d.lease_id for d in world.site.of_kind(LeaseDone)] == [2]
    assert "its samples could not be read" in caplog.text and "HTTP 404" in caplog.text


def test_rows_of_another_shape_are_refused_by_name() -> None:
    arriving = trainer.ArrivingSamples(6, (torch.zeros(3, 5), torch.zeros(3, dtype=torch.long)))

    with pytest.raises(ValueError, match=r"shaped \(4,\) does not fit rows 3\.\.5 of a lease of 6 samples shaped \(5,"):
        arriving.put(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="does not fit rows 3..6"):
        arriving.put(torch.zeros(4, 5), torch.zeros(4, dtype=torch.long))
