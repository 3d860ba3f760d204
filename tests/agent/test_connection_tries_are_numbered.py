"""Every control handshake names its try, so the site can tell a stale try from the agent's newest.

A site process acting late on a handshake the agent gave up on must not
replace the agent's newer, working socket (``crowdtrain.gateway.tries``).
"""

from __future__ import annotations

from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.protocol import parse_connection_try
from crowdtrain_agent.runtime import Agent

from .conftest import FAST_BACKOFF
from .fakes import World


async def test_each_try_of_one_agent_names_its_instance_and_a_higher_number(world: World, config: AgentConfig) -> None:
    world.site.refuse_handshakes = [503, 503]
    world.site.replies = [world.lease(1, [(0, 8)]), world.lease(2, [(8, 8)])]

    code = await Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01).run()

    tries = [parse_connection_try(value) for value in world.site.tries]
    assert code == 0
    assert len(tries) == 3 and all(t is not None for t in tries)
    assert len({t.instance for t in tries if t}) == 1
    assert [t.number for t in tries if t] == [1, 2, 3]


async def test_two_agent_processes_name_different_instances(world: World, config: AgentConfig) -> None:
    world.site.replies = [world.lease(1, [(0, 8)]), world.lease(2, [(8, 8)])]
    await Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01).run()
    world.site.replies = [world.lease(3, [(16, 8)]), world.lease(4, [(24, 8)])]
    await Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01).run()

    first, second = (parse_connection_try(value) for value in world.site.tries)
    assert first is not None and second is not None
    assert first.instance != second.instance
    assert first.number == second.number == 1
