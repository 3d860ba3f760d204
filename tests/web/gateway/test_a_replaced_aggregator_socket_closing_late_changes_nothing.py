"""Only an aggregator's current socket speaks for it: the late close of a replaced one leaves its slices ready.

An aggregator that reconnects gets its slices back on the new socket; when
the old socket closed after that, the site used to mark every slice not ready
and the campaign stood still while its aggregator was connected and working.
"""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from crowdtrain.campaigns.models import Campaign
from crowdtrain.scheduler.models import Aggregator, SliceAssignment
from crowdtrain_agent.protocol import PROTOCOL_VERSION, BackboneHello, SliceReady
from crowdtrain_agent.protocol import SliceAssignment as AssignMessage
from tests.factories import make_campaign

from .conftest import Connect, receive, send

pytestmark = pytest.mark.django_db(transaction=True)


def _slice_ready(campaign: Campaign) -> bool:
    return SliceAssignment.objects.get(campaign=campaign, index=0).ready


async def _join(connect: Connect, campaign: Campaign) -> WebsocketCommunicator:
    """Connect as the campaign's aggregator, take its slice back, and wait until the site counts it ready."""
    aggregator = await sync_to_async(lambda: SliceAssignment.objects.get(campaign=campaign, index=0).aggregator)()
    communicator, _, _ = await connect("/ws/backbone/", f"token-{aggregator.name}")
    hello = BackboneHello(
        protocol_version=PROTOCOL_VERSION,
        name=aggregator.name,
        upload_url="ws://x/upload",
        params_url="http://x/params/",
    )
    await send(communicator, hello)
    await receive(communicator)  # welcome
    assignment = await receive(communicator)
    assert isinstance(assignment, AssignMessage)
    await send(communicator, SliceReady(campaign_id=campaign.pk, slice_index=0, version=0))
    for _ in range(100):  # handled asynchronously; nothing is sent back for one slice at version 0
        if await sync_to_async(_slice_ready)(campaign):
            break
        await asyncio.sleep(0.02)
    return communicator


async def test_the_replaced_socket_closing_after_the_newer_one_joined_leaves_the_slices_ready(connect: Connect) -> None:
    campaign = await sync_to_async(make_campaign)()
    older = await _join(connect, campaign)
    newer = await _join(connect, campaign)
    assert await older.receive_output(timeout=5) == {"type": "websocket.close", "code": 4012}

    await older.disconnect()  # the old socket's disconnect runs only now, after the newer one is ready

    assert await sync_to_async(_slice_ready)(campaign)
    assert await sync_to_async(lambda: Aggregator.objects.get(slices__campaign=campaign).connected)()
    assert await newer.receive_nothing(timeout=0.1)


async def test_the_current_socket_closing_still_pauses_the_slices(connect: Connect) -> None:
    campaign = await sync_to_async(make_campaign)()
    current = await _join(connect, campaign)

    await current.disconnect()

    assert not await sync_to_async(_slice_ready)(campaign)
    assert not await sync_to_async(lambda: Aggregator.objects.get(slices__campaign=campaign).connected)()
