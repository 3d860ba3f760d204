"""A saturated site turns away new work only: new sockets get 4013, new lease requests a growing wait."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from django.test import override_settings

from crowdtrain.gateway.admission import admission
from crowdtrain_agent.protocol import CloseCode, DoneAck, LeaseRequest, NoLease, should_reconnect
from tests.factories import done_for, make_campaign, make_device

from .conftest import Connect, greeted_agent, receive, send

pytestmark = pytest.mark.django_db(transaction=True)


@override_settings(CROWDTRAIN_MAX_HANDSHAKES=1)
async def test_a_new_socket_beyond_the_handshake_limit_is_told_to_try_again_later(connect: Connect) -> None:
    _, token = await sync_to_async(make_device)("late")
    admission.handshakes += 1  # another socket's token lookup is still in hand
    try:
        communicator, _, _ = await connect("/ws/agent/", token)
        output = await communicator.receive_output(timeout=5)
    finally:
        admission.handshakes -= 1

    assert output == {"type": "websocket.close", "code": CloseCode.TRY_AGAIN_LATER}
    assert should_reconnect(CloseCode.TRY_AGAIN_LATER)  # an agent backs off and comes back; it does not quit


@override_settings(CROWDTRAIN_MAX_LEASE_CALLS=1)
async def test_a_busy_site_refuses_new_leases_with_a_longer_wait_but_still_counts_work_done(connect: Connect) -> None:
    await sync_to_async(make_campaign)(target_batch_size=16)
    agent = await greeted_agent(connect, "alice")
    await send(agent, LeaseRequest())
    lease = await receive(agent)
    admission.lease_calls += 1  # the process has as many lease requests in hand as it takes
    try:
        await send(agent, LeaseRequest())
        busy = await receive(agent)
        await send(agent, await sync_to_async(done_for)(lease.lease_id))
        ack = await receive(agent)
    finally:
        admission.lease_calls -= 1

    assert isinstance(busy, NoLease) and "busy" in busy.detail
    assert busy.retry_after_s > 2.0  # more than the idle site's CROWDTRAIN_RETRY_AFTER_S
    assert isinstance(ack, DoneAck) and ack.accepted
