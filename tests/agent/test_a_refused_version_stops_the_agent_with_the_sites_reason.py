"""A site that refuses this agent's protocol makes it stop at once and say why, at normal verbosity.

Before, an error frame in place of the welcome read as a failed connect: the
agent retried for its whole backoff (25 minutes) and ended with "check the
network", the site's "upgrade" visible only with ``-v``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from websockets.asyncio.server import ServerConnection, serve

from crowdtrain_agent.control import AgentStopped, ControlChannel
from crowdtrain_agent.protocol import (
    PROTOCOL_VERSION,
    AgentHello,
    CloseCode,
    DeviceInfo,
    ErrorMessage,
    encode_message,
)

from .conftest import FAST_BACKOFF

HELLO = AgentHello(
    protocol_version=PROTOCOL_VERSION, agent_version="test",
    device=DeviceInfo(kind="cpu", name="test cpu", threads=1, flops_per_s=1e9),
)  # fmt: skip
REASON = "protocol version 2.0 is not supported (this site speaks 3.0 to 3.2); upgrade crowdtrain-agent"


async def _refused_by(site: Callable[[ServerConnection], Awaitable[None]]) -> tuple[AgentStopped, int]:
    connections = 0

    async def handler(ws: ServerConnection) -> None:
        nonlocal connections
        connections += 1
        await ws.recv()  # the hello
        await site(ws)

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        channel = ControlChannel(f"ws://127.0.0.1:{port}/ws/agent/", "ctd_x", HELLO, backoff=FAST_BACKOFF)
        with pytest.raises(AgentStopped) as stopped:
            await asyncio.wait_for(channel.run(), 30)
    return stopped.value, connections


async def test_an_error_frame_then_4004_stops_it_saying_upgrade_and_the_sites_words() -> None:
    async def older_site(ws: ServerConnection) -> None:  # what sites before 2.6 sent
        await ws.send(encode_message(ErrorMessage(code="unsupported version", detail=REASON)))
        await ws.close(CloseCode.UNSUPPORTED_VERSION)

    stopped, connections = await _refused_by(older_site)

    assert connections == 1, "a refusal is not retried"
    assert "upgrade: pip install -U crowdtrain-agent" in str(stopped)
    assert REASON in str(stopped)


async def test_a_close_with_a_reason_is_said_with_the_hint() -> None:
    async def site(ws: ServerConnection) -> None:
        await ws.close(CloseCode.UNSUPPORTED_VERSION, REASON)

    stopped, connections = await _refused_by(site)

    assert connections == 1
    assert str(stopped).endswith(f"(the site said: {REASON})")
