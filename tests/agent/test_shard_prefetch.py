"""Shards a lease says the next leases will read are fetched in the background, before any lease needs them."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np

from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.data import sha256_hex
from crowdtrain_agent.protocol import LeaseDone
from crowdtrain_agent.runtime import Agent
from tests.shards import make_tensor_shards

from .conftest import FAST_BACKOFF
from .fakes import World


def _another_shard(world: World) -> tuple[str, bytes]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, world.x.shape[1])).astype(np.float32)
    y = rng.integers(0, 3, size=4).astype(np.int64)
    ((shard, _),) = list(make_tensor_shards(x, y, 4))
    return sha256_hex(shard), shard


async def test_it_fetches_the_shards_a_lease_names_for_the_next_leases(world: World, config: AgentConfig) -> None:
    sha, shard = _another_shard(world)
    world.site.shards[sha] = shard
    world.site.replies = [msgspec.structs.replace(world.lease(1, [(0, 4)]), prefetch=[sha, "not-a-digest"])]
    agent = Agent(AgentConfig(**{**config.__dict__, "max_leases": 1}), backoff=FAST_BACKOFF, benchmark_s=0.01)

    code = await asyncio.wait_for(agent.run(), 10)
    for _ in range(100):  # the prefetch runs in its own thread
        if sha in world.site.shard_requests:
            break
        await asyncio.sleep(0.05)

    assert code == 0
    assert sorted(world.site.shard_requests) == sorted([world.sha, sha])  # the named one, once; no bad name asked
    assert (config.cache_dir / "shards" / sha[:2] / sha).read_bytes() == shard


async def test_a_shard_that_fails_to_prefetch_does_not_stop_the_work(world: World, config: AgentConfig) -> None:
    missing = "0" * 64
    world.site.replies = [msgspec.structs.replace(world.lease(1, [(0, 4)]), prefetch=[missing])]
    agent = Agent(AgentConfig(**{**config.__dict__, "max_leases": 1}), backoff=FAST_BACKOFF, benchmark_s=0.01)

    code = await asyncio.wait_for(agent.run(), 10)

    assert code == 0
    assert [done.lease_id for done in world.site.of_kind(LeaseDone)] == [1]
    assert missing in world.site.shard_requests  # tried, answered 404, and let go
