"""When the site has no work, the agent says why and asks again later, or at once when a version is published."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.protocol import LeaseDone, LeaseRequest, NoLease
from crowdtrain_agent.runtime import Agent

from .conftest import FAST_BACKOFF
from .fakes import World


async def test_no_lease_reason_is_shown_and_the_request_retried(
    world: World, config: AgentConfig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="crowdtrain_agent")
    world.site.replies = [
        NoLease(reason="step_full", detail="step 3 is full", retry_after_s=0.1),
        world.lease(1, [(0, 4)]),
        world.lease(2, [(4, 4)]),
    ]
    agent = Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01)

    await agent.run()

    assert "no lease from the site (step full: step 3 is full)" in caplog.text
    assert len(world.site.of_kind(LeaseRequest)) == 3
    assert [d.lease_id for d in world.site.of_kind(LeaseDone)] == [1, 2]


async def test_a_published_version_ends_the_wait_early(world: World, config: AgentConfig) -> None:
    wait = NoLease(reason="waiting_for_version", detail="", retry_after_s=60.0)
    world.site.replies = [wait, world.lease(1, [(0, 4)])]
    agent = Agent(AgentConfig(**{**config.__dict__, "max_leases": 1}), backoff=FAST_BACKOFF, benchmark_s=0.01)
    run = asyncio.create_task(agent.run())
    while not world.site.of_kind(LeaseRequest):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)

    await world.site.push_version(7, 1)
    code = await asyncio.wait_for(run, 10)

    assert code == 0
    assert agent.status.version == 1
    assert [d.lease_id for d in world.site.of_kind(LeaseDone)] == [1]


async def test_after_a_lease_that_names_the_next_version_it_waits_for_that_push_before_asking(
    world: World, config: AgentConfig
) -> None:
    hinted = dataclasses.replace(world.lease(1, [(0, 4)]), next_lease_at_version=1)
    world.site.replies = [hinted, world.lease(2, [(4, 4)])]
    agent = Agent(AgentConfig(**{**config.__dict__, "max_leases": 2}), backoff=FAST_BACKOFF, benchmark_s=0.01)
    run = asyncio.create_task(agent.run())
    while not world.site.of_kind(LeaseDone):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    asked_before_push = len(world.site.of_kind(LeaseRequest))

    await world.site.push_version(7, 1)
    code = await asyncio.wait_for(run, 10)

    assert code == 0
    assert asked_before_push == 1  # lease 1 computed and reported; no request until version 1
    assert [d.lease_id for d in world.site.of_kind(LeaseDone)] == [1, 2]
