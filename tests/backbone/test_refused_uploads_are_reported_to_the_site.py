"""An upload refused for its content is reported to the site (``upload_refused``), which counts it against its sender.

Only refusals an honest agent never meets, and only to a site of 2.7 or
newer: an older one would answer a kind it does not know with errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from crowdtrain_agent.protocol import (
    UPLOAD_REFUSED_SINCE,
    SliceReady,
    UploadRefused,
    UploadRejected,
    offered_subprotocols,
)
from crowdtrain_backbone.server import BackboneServer

from .conftest import SLICE0, Agent, FakeSite, agent_connection, gradient, ticket

NUMEL = SLICE0[1] - SLICE0[0]


@pytest.fixture
async def agent(backbone: BackboneServer) -> AsyncIterator[Agent]:
    """An agent of this protocol minor: it checks its gradient before uploading, so its refusals count."""
    async with agent_connection(backbone, offered_subprotocols()) as connected:
        yield connected


def _nan_gradient() -> object:
    grad = gradient(NUMEL, 3)
    grad[::5] = float("nan")
    return grad


async def test_a_nan_upload_is_refused_and_reported(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    assert backbone.link is not None
    backbone.link.minor = UPLOAD_REFUSED_SINCE  # a site of 2.7 (the fake site negotiates none)

    reply = await agent.upload(ticket(41), _nan_gradient())  # type: ignore[arg-type]
    told = await site.expect(UploadRefused)

    assert isinstance(reply, UploadRejected) and reply.code == "not finite"
    assert (told.campaign_id, told.lease_id, told.slice_index, told.code) == (1, 41, 0, "not finite")
    assert "NaN or infinite" in told.detail


async def test_a_site_older_than_2_7_is_not_told(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    assert backbone.link is not None
    backbone.link.minor = UPLOAD_REFUSED_SINCE - 1

    reply = await agent.upload(ticket(42), _nan_gradient())  # type: ignore[arg-type]

    assert isinstance(reply, UploadRejected) and reply.code == "not finite"
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(site.received.get(), 1.0)


async def test_a_refusal_an_honest_agent_can_meet_is_not_reported(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    assert backbone.link is not None
    backbone.link.minor = UPLOAD_REFUSED_SINCE

    reply = await agent.upload(ticket(43, base_version=5), gradient(NUMEL, 4))  # a version it does not hold

    assert isinstance(reply, UploadRejected) and reply.code != "not finite"
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(site.received.get(), 1.0)


async def test_a_lease_is_reported_once_however_often_its_upload_is_refused(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    assert backbone.link is not None
    backbone.link.minor = UPLOAD_REFUSED_SINCE

    for _ in range(3):  # a header with a good ticket costs the sender little; each try must not cost the site
        reply = await agent.upload(ticket(44), _nan_gradient())  # type: ignore[arg-type]
        assert isinstance(reply, UploadRejected) and reply.code == "not finite"
    first = await site.expect(UploadRefused)

    assert first.lease_id == 44
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(site.received.get(), 1.0)


async def test_an_agent_older_than_2_7_is_not_reported(
    site: FakeSite, held: SliceReady, backbone: BackboneServer
) -> None:
    assert backbone.link is not None
    backbone.link.minor = UPLOAD_REFUSED_SINCE
    async with agent_connection(backbone, [f"crowdtrain.2.{UPLOAD_REFUSED_SINCE - 1}"]) as older:
        # It uploads without checking its gradient first: an honest divergence must not count against it.
        reply = await older.upload(ticket(45), _nan_gradient())  # type: ignore[arg-type]

    assert isinstance(reply, UploadRejected) and reply.code == "not finite"
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(site.received.get(), 1.0)
