"""A slice the aggregator rejects means the lease cannot be reported: it is given back instead."""

from __future__ import annotations

from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.protocol import LeaseDone, LeaseRelease
from crowdtrain_agent.runtime import Agent

from .conftest import FAST_BACKOFF
from .fakes import World


async def test_a_rejected_upload_releases_the_lease_instead_of_reporting_it(world: World, config: AgentConfig) -> None:
    world.aggregators[1].reject_code = "stale version"
    world.site.replies = [world.lease(1, [(0, 8)])]
    agent = Agent(AgentConfig(**{**config.__dict__, "max_leases": 1}), backoff=FAST_BACKOFF, benchmark_s=0.01)

    code = await agent.run()

    assert code == 0
    assert world.site.of_kind(LeaseDone) == []
    assert world.site.of_kind(LeaseRelease) == [LeaseRelease(lease_id=1)]
    assert agent.status.rejected == 1
