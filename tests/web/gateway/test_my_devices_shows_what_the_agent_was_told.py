"""My devices' "Now:" is what the site last told the agent: its lease, its refusal in the agent's own words, its
place in the queue; published in Presence's batch and gone when the agent disconnects."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser

from crowdtrain.accounts.models import Device
from crowdtrain.scheduler.hotstate import hot_state, presence
from crowdtrain_agent.protocol import DoneAck, LeaseRequest, NoLease, no_lease_status
from crowdtrain_agent.protocol import Lease as LeaseMessage
from tests.conftest import FakeClock
from tests.factories import done_for, logged_in, make_campaign

from .conftest import Connect, greeted_agent, receive, send

pytestmark = pytest.mark.django_db(transaction=True)

WHOLE_STEP = 1e6  # samples/s: a lease takes all the room left in its step


async def _agent(connect: Connect) -> tuple[WebsocketCommunicator, Device]:
    from tests.factories import make_device

    device, token = await sync_to_async(make_device)("owner", "desk gpu")
    return await greeted_agent(connect, token=token), device


def _feed(owner: AbstractBaseUser) -> dict[str, Any]:
    presence.publish()  # the housekeeping batch, run now instead of in a few seconds
    client = logged_in(owner)
    (row,) = client.get("/devices/status").json()["devices"]
    return row


async def test_a_refusal_reads_on_the_page_as_the_agent_shows_it(connect: Connect) -> None:
    agent, device = await _agent(connect)

    await send(agent, LeaseRequest())
    refusal = await receive(agent)
    row = await sync_to_async(_feed)(device.owner)

    assert isinstance(refusal, NoLease) and refusal.reason == "no_campaign"
    # The agent's status line is no_lease_status of the refusal it got (tests/agent/test_no_lease.py).
    assert row["now_text"] == no_lease_status(refusal.reason, refusal.detail)
    assert row["now_text"] == "waiting for work (no campaign: no running campaign accepts volunteers right now)"
    assert row["now"]["kind"] == "idle" and 0 < row["now"]["expected_wait_s"] <= refusal.retry_after_s
    assert row["wait_text"].startswith("asks again within ")


async def test_a_lease_then_its_report_show_as_they_happen(connect: Connect) -> None:
    campaign = await sync_to_async(make_campaign)(target_batch_size=8, microbatch_size=4)
    agent, device = await _agent(connect)
    await send(agent, LeaseRequest(samples_per_s=WHOLE_STEP))
    lease = await receive(agent)

    training = await sync_to_async(_feed)(device.owner)
    await send(agent, await sync_to_async(done_for)(lease.lease_id))
    ack = await receive(agent)
    reported = await sync_to_async(_feed)(device.owner)

    assert isinstance(lease, LeaseMessage) and isinstance(ack, DoneAck) and ack.accepted
    assert training["now_text"].startswith(f"training lease {lease.lease_id} of test campaign (8 samples, due in ")
    assert training["now"]["campaign"] == {"id": campaign.pk, "name": "test campaign"}
    assert training["now"]["lease_id"] == lease.lease_id
    assert reported["now_text"] == f"reported lease {lease.lease_id} of test campaign: accepted"
    assert [row["id"] for row in reported["leases"]] == [lease.lease_id]
    assert reported["leases"][0]["samples_text"] == "8 samples"


async def test_a_request_held_for_the_next_commit_shows_as_waiting_for_the_next_step(connect: Connect) -> None:
    await sync_to_async(make_campaign)(target_batch_size=16, staleness=0)
    alice = await greeted_agent(connect, "alice")
    await send(alice, LeaseRequest(samples_per_s=WHOLE_STEP))
    await receive(alice)  # the whole of step 0
    bob, device = await _agent(connect)

    await send(bob, LeaseRequest(samples_per_s=WHOLE_STEP, wait_s=5.0))
    held = await bob.receive_nothing(timeout=0.3)
    row = await sync_to_async(_feed)(device.owner)

    assert held
    assert row["now"]["kind"] == "queued" and row["now"]["expected_wait_s"] is None
    assert row["now_text"] == (
        "waiting for the next step of test campaign (queued at the site until the campaign has committed 1 step)"
    )


async def test_the_record_is_deleted_when_the_agent_disconnects(connect: Connect, clock: FakeClock) -> None:
    agent, device = await _agent(connect)
    await send(agent, LeaseRequest())
    await receive(agent)
    before = await sync_to_async(_feed)(device.owner)
    key = hot_state().activity_key(device.pk)
    published = hot_state().client.get(key)

    await agent.disconnect()
    await sync_to_async(presence.publish)()
    clock.advance(settings.CROWDTRAIN_GONE_AFTER_S + 1)
    after = await sync_to_async(_feed)(device.owner)

    assert before["now"]["kind"] == "idle" and published
    assert hot_state().client.get(key) is None
    assert (after["online"], after["now"], after["now_text"]) == (False, None, "offline")
