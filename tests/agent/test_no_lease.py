"""When the site has no work, the agent says why and asks again later, or at once when a version is published."""

from __future__ import annotations

import asyncio
import logging

import pytest

from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.protocol import LeaseDone, LeaseRequest, NoLease, no_lease_status
from crowdtrain_agent.runtime import LEASE_WAIT_S, Agent

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
    wait = NoLease(reason="campaign_paused", detail="waiting for aggregators", retry_after_s=60.0)
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


async def test_its_status_line_is_the_words_my_devices_shows(world: World, config: AgentConfig) -> None:
    wait = NoLease(reason="campaign_paused", detail="waiting for aggregators", retry_after_s=60.0)
    world.site.replies = [wait, world.lease(1, [(0, 4)])]
    agent = Agent(AgentConfig(**{**config.__dict__, "max_leases": 1}), backoff=FAST_BACKOFF, benchmark_s=0.01)
    run = asyncio.create_task(agent.run())
    for _ in range(1000):  # at most 10 s
        if agent.status.status.startswith("waiting for work"):
            break
        await asyncio.sleep(0.01)

    shown = agent.status.status
    await world.site.push_version(7, 1)
    await asyncio.wait_for(run, 10)

    # The site words the same refusal with the same function (tests/web/gateway/test_my_devices_shows_...).
    assert shown == no_lease_status(wait.reason, wait.detail)
    assert shown == "waiting for work (campaign paused: waiting for aggregators)"


async def test_its_requests_let_the_site_hold_them_until_a_step_has_room(world: World, config: AgentConfig) -> None:
    world.site.replies = [world.lease(1, [(0, 4)])]
    agent = Agent(AgentConfig(**{**config.__dict__, "max_leases": 1}), backoff=FAST_BACKOFF, benchmark_s=0.01)

    await asyncio.wait_for(agent.run(), 10)

    (request,) = world.site.of_kind(LeaseRequest)
    assert request.wait_s == LEASE_WAIT_S > 0
