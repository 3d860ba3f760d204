"""An HTTP answer to the control socket's handshake is retried, never read as a rejected token.

The site refuses a token only with a close code on an accepted socket. An
HTTP 403 is daphne too busy to accept in time, a 502 or 503 a proxy in front
of a restarting site: agents that quit on them left a busy site for good.
"""

from __future__ import annotations

import logging

import pytest

from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.runtime import Agent

from .conftest import FAST_BACKOFF
from .fakes import World


@pytest.mark.parametrize("statuses", [[403], [503, 502], [401, 500]])
async def test_it_retries_http_refusals_of_the_handshake_and_works(
    world: World, config: AgentConfig, statuses: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="crowdtrain_agent")
    world.site.refuse_handshakes = list(statuses)
    world.site.replies = [world.lease(1, [(0, 8)]), world.lease(2, [(8, 8)])]

    code = await Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01).run()

    assert code == 0
    assert world.site.refuse_handshakes == []
    assert len(world.site.hellos) == 1
    assert f"HTTP {statuses[0]}" in caplog.text
    assert "busy or unreachable" in caplog.text and "keeps trying" in caplog.text
