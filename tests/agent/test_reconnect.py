"""A dropped control connection is re-established with backoff and the work goes on."""

from __future__ import annotations

import logging

import pytest

from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.control import AgentStopped
from crowdtrain_agent.protocol import LeaseDone
from crowdtrain_agent.runtime import Agent

from .conftest import FAST_BACKOFF
from .fakes import World


async def test_it_reconnects_after_the_site_drops_the_connection(
    world: World, config: AgentConfig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="crowdtrain_agent")
    world.site.drop_after_done = True
    world.site.replies = [world.lease(1, [(0, 8)]), world.lease(2, [(8, 8)])]

    code = await Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01).run()

    assert code == 0
    assert world.site.connections == 2
    assert len(world.site.hellos) == 2
    assert "reconnected after 1 tries" in caplog.text
    assert [d.lease_id for d in world.site.of_kind(LeaseDone)] == [1, 2]


async def test_it_gives_up_with_a_hint_when_the_site_stays_unreachable(
    world: World, config: AgentConfig, caplog: pytest.LogCaptureFixture
) -> None:
    url = world.site.url
    await world.site.stop()

    with pytest.raises(AgentStopped, match="check the network and the --server address"):
        await Agent(AgentConfig(**{**config.__dict__, "server": url}), backoff=FAST_BACKOFF, benchmark_s=0.01).run()

    assert "giving up on" in caplog.text
