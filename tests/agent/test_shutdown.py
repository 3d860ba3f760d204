"""Ctrl-C: the first finishes the lease in progress and gives back the one not started; the second exits now."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from crowdtrain_agent import trainer
from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.protocol import LeaseDone, LeaseRelease, LeaseRequest, NoLease
from crowdtrain_agent.runtime import EXIT_INTERRUPTED, Agent

from .conftest import FAST_BACKOFF
from .fakes import World


async def test_first_stop_reports_the_current_lease_and_releases_the_unstarted_one(
    world: World, config: AgentConfig
) -> None:
    # Lease 2 needs version 1, whose parameters take a while: it is fetched but not yet computed when we stop.
    world.aggregators[0].params[(0, 1)] = world.aggregators[0].params[(0, 0)]
    world.aggregators[1].params[(1, 1)] = world.aggregators[1].params[(1, 0)]
    world.aggregators[0].slow_versions[1] = 0.5
    world.site.replies = [world.lease(1, [(0, 8)]), world.lease(2, [(8, 8)], version=1)]
    agent = Agent(AgentConfig(**{**config.__dict__, "max_leases": None}), backoff=FAST_BACKOFF, benchmark_s=0.01)
    run = asyncio.create_task(agent.run())
    while "/params/0/1" not in world.aggregators[0].param_requests:
        await asyncio.sleep(0.01)

    agent.request_stop()
    code = await asyncio.wait_for(run, 10)

    assert code == 0
    assert [d.lease_id for d in world.site.of_kind(LeaseDone)] == [1]
    assert world.site.of_kind(LeaseRelease) == [LeaseRelease(lease_id=2)]
    assert (2, 0) not in world.aggregators[0].uploads


async def test_second_stop_releases_the_lease_in_progress_and_exits_at_once(
    world: World, config: AgentConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    computing = asyncio.Event()
    loop = asyncio.get_running_loop()
    real = trainer.compute_gradient

    def slow_compute(*args: Any, **kwargs: Any) -> trainer.GradientResult:
        loop.call_soon_threadsafe(computing.set)
        time.sleep(3.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "compute_gradient", slow_compute)
    world.site.replies = [world.lease(1, [(0, 8)])]
    agent = Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01)
    run = asyncio.create_task(agent.run())
    await computing.wait()

    agent.request_stop()
    agent.request_stop()
    started = time.monotonic()
    code = await asyncio.wait_for(run, 10)

    assert code == EXIT_INTERRUPTED
    assert time.monotonic() - started < 1.5
    assert world.site.of_kind(LeaseRelease) == [LeaseRelease(lease_id=1)]
    assert world.site.of_kind(LeaseDone) == []


async def test_stop_while_waiting_for_work_exits_without_waiting_for_the_retry(
    world: World, config: AgentConfig
) -> None:
    world.site.replies = [NoLease(reason="no_campaign", detail="nothing running", retry_after_s=60.0)]
    agent = Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01)
    run = asyncio.create_task(agent.run())
    while not world.site.of_kind(LeaseRequest):
        await asyncio.sleep(0.01)

    agent.request_stop()
    code = await asyncio.wait_for(run, 2)

    assert code == 0


async def test_stop_while_the_site_is_unreachable_exits(world: World, config: AgentConfig) -> None:
    await world.site.stop()
    agent = Agent(config, benchmark_s=0.01)
    run = asyncio.create_task(agent.run())
    await asyncio.sleep(0.3)

    agent.request_stop()
    code = await asyncio.wait_for(run, 2)

    assert code == 0
