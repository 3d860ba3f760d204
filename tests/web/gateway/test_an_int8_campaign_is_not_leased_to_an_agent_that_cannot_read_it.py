"""The int8 codec is protocol 2.3: an agent of 2.2 is told to upgrade instead of getting a lease it cannot read.

Its lease is given back at once, so the samples go to another agent rather
than wait for the deadline. An agent of 2.3 gets the lease with the block size.
"""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from django.test import override_settings

from crowdtrain.campaigns.setup import CampaignConfigError
from crowdtrain.scheduler.models import Lease as LeaseRow
from crowdtrain_agent.protocol import PROTOCOL_MINOR, Lease, LeaseRequest
from tests.factories import make_campaign

from .conftest import Connect, greeted_agent, lease_asked_by_an_agent_of_minor, receive, send

pytestmark = pytest.mark.django_db(transaction=True)


async def test_an_agent_of_minor_2_is_told_to_upgrade_and_its_lease_goes_back() -> None:
    await sync_to_async(make_campaign)(codec="int8", codec_block_size=128)

    frame, closed = await lease_asked_by_an_agent_of_minor(2)

    states = await sync_to_async(lambda: list(LeaseRow.objects.values_list("state", flat=True)))()
    assert frame["kind"] == "error" and frame["code"] == "unsupported version"
    assert "codec=int8" in frame["detail"] and "upgrade crowdtrain-agent to speak 2.3" in frame["detail"]
    assert (closed["type"], closed["code"]) == ("websocket.close", 4004)
    assert states == [LeaseRow.State.RELEASED]


async def test_an_agent_of_this_minor_gets_the_int8_lease_with_its_block_size(connect: Connect) -> None:
    await sync_to_async(make_campaign)(codec="int8", codec_block_size=128)
    agent = await greeted_agent(connect)

    await send(agent, LeaseRequest())
    lease = await receive(agent)

    assert PROTOCOL_MINOR >= 3
    assert isinstance(lease, Lease) and (lease.codec, lease.codec_block_size) == ("int8", 128)


def test_a_site_pinned_below_2_3_refuses_an_int8_campaign() -> None:
    with override_settings(CROWDTRAIN_PROTOCOL_MINOR=2), pytest.raises(CampaignConfigError) as caught:
        make_campaign(codec="int8")

    assert caught.value.field == "codec"
    assert "needs protocol 2.3, and this site is pinned to 2.2 (CROWDTRAIN_PROTOCOL_MINOR)" in str(caught.value)
