"""An upload socket that sends no upload header within header_timeout_s of connecting is closed (4000).

Sockets that only connect used to stay open for minutes. A connection that
has carried an upload may idle between leases: agents keep it for the next one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed

from crowdtrain_agent.protocol import CloseCode

from .conftest import FakeSite, agent_connection, assignment, running_backbone


async def test_a_socket_that_sends_nothing_is_closed_with_4000(site: FakeSite, tmp_path: Path) -> None:
    async with running_backbone(site, tmp_path, header_timeout_s=0.2) as server, agent_connection(server) as agent:
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(agent.ws.recv(), 5)

    assert closed.value.rcvd is not None and closed.value.rcvd.code == CloseCode.BAD_MESSAGE
    assert "no upload header within 0.2 s" in closed.value.rcvd.reason


async def test_a_socket_that_uploaded_may_idle_past_the_deadline(site: FakeSite, tmp_path: Path) -> None:
    async with running_backbone(site, tmp_path, header_timeout_s=0.2) as server:
        await site.assign(assignment())
        async with agent_connection(server) as agent:
            await agent.good_upload(1)

            await asyncio.sleep(0.5)
            receipt = await agent.good_upload(2)

    assert receipt.lease_id == 2
