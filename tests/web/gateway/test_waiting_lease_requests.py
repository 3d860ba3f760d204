"""A lease request that finds every step full waits at the site and is answered by the commit that makes room."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.exceptions import ChannelFull
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.test import override_settings

from crowdtrain.campaigns.keys import ticket_key
from crowdtrain.gateway.outbox import wake
from crowdtrain.scheduler import leasing, parking, reporting
from crowdtrain.scheduler.models import Lease
from crowdtrain_agent.protocol import DoneAck, ErrorMessage, LeaseRequest, NoLease, verify_ticket
from crowdtrain_agent.protocol import Lease as LeaseMessage
from crowdtrain_agent.sketch import SKETCH_SIZE, to_bytes
from tests.factories import done_for, make_campaign, make_device

from .conftest import Connect, greeted_agent, receive, send

pytestmark = pytest.mark.django_db(transaction=True)

WHOLE_STEP = 1e6  # samples/s: any lease is capped by the room left in its step, so this takes all of it


async def _alice_holds_the_step(connect: Connect) -> tuple[WebsocketCommunicator, WebsocketCommunicator, Any]:
    """A campaign of 16-sample steps whose open step alice's first lease (returned) takes whole; bob idle beside."""
    await sync_to_async(make_campaign)(target_batch_size=16, staleness=0)
    alice, bob = await greeted_agent(connect, "alice"), await greeted_agent(connect, "bob")
    await send(alice, LeaseRequest(samples_per_s=WHOLE_STEP))
    return alice, bob, await receive(alice)


async def test_a_request_for_a_full_step_is_answered_by_the_commit_that_makes_room(connect: Connect) -> None:
    await sync_to_async(make_campaign)(target_batch_size=16, staleness=0)
    agent = await greeted_agent(connect, "alice")
    await send(agent, LeaseRequest(samples_per_s=WHOLE_STEP))
    first = await receive(agent)

    await send(agent, LeaseRequest(samples_per_s=WHOLE_STEP, wait_s=5.0))
    held = await agent.receive_nothing(timeout=0.3)
    await send(agent, await sync_to_async(done_for)(first.lease_id))
    ack = await receive(agent)
    following = await receive(agent)

    assert held  # no refusal while step 0 was in flight
    assert isinstance(ack, DoneAck) and ack.accepted
    assert isinstance(following, LeaseMessage) and following.base_version == 1


async def test_another_devices_commit_wakes_a_waiting_request(connect: Connect) -> None:
    alice, bob, first = await _alice_holds_the_step(connect)

    await send(bob, LeaseRequest(samples_per_s=WHOLE_STEP, wait_s=5.0))
    held = await bob.receive_nothing(timeout=0.3)
    await send(alice, await sync_to_async(done_for)(first.lease_id))
    await receive(alice)
    woken = await receive(bob)

    assert held
    assert isinstance(woken, LeaseMessage) and woken.base_version == 1


@override_settings(CROWDTRAIN_LEASE_WAIT_MAX_S=0.3)
async def test_a_waiting_request_gets_the_refusal_when_the_sites_limit_is_up(connect: Connect) -> None:
    alice, bob, _ = await _alice_holds_the_step(connect)

    await send(bob, LeaseRequest(samples_per_s=WHOLE_STEP, wait_s=60.0))
    refusal = await receive(bob, timeout=5)

    assert isinstance(refusal, NoLease) and refusal.reason == "step_full"
    assert refusal.ready_at_step == 1


async def test_a_request_without_wait_s_is_refused_at_once(connect: Connect) -> None:
    alice, bob, _ = await _alice_holds_the_step(connect)

    await send(bob, LeaseRequest(samples_per_s=WHOLE_STEP))
    refusal = await receive(bob, timeout=1)

    assert isinstance(refusal, NoLease) and refusal.reason == "step_full"


@pytest.mark.parametrize("wait_s", [-1.0, -1e-9])
async def test_it_refuses_a_negative_wait(connect: Connect, wait_s: float) -> None:
    await sync_to_async(make_campaign)(target_batch_size=16)
    agent = await greeted_agent(connect, "alice")

    await send(agent, LeaseRequest(wait_s=wait_s))
    reply = await receive(agent)

    assert isinstance(reply, ErrorMessage) and "LeaseRequest.wait_s: expected float >= 0.0" in reply.detail


async def test_a_commit_wakes_only_as_many_waiting_requests_as_its_room_serves(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[int] = []
    real_ask = leasing.ask_lease
    monkeypatch.setattr(
        leasing, "ask_lease", lambda device_id, *a, **k: asked.append(device_id) or real_ask(device_id, *a, **k)
    )
    await sync_to_async(make_campaign)(target_batch_size=16, staleness=0)
    alice = await greeted_agent(connect, "alice")
    waiting = [await greeted_agent(connect, name) for name in ("bob", "carol", "dave")]
    await send(alice, LeaseRequest(samples_per_s=WHOLE_STEP))
    first = await receive(alice)
    for agent in waiting:  # each would take a whole step
        await send(agent, LeaseRequest(samples_per_s=WHOLE_STEP, wait_s=5.0))
        assert await agent.receive_nothing(timeout=0.1)

    asked.clear()

    await send(alice, await sync_to_async(done_for)(first.lease_id))
    await receive(alice)
    woken = await receive(waiting[0])
    others_held = [await agent.receive_nothing(timeout=0.3) for agent in waiting[1:]]

    assert isinstance(woken, LeaseMessage) and woken.base_version == 1
    assert others_held == [True, True]  # the first in line got the room; the rest wait for the next commits
    assert len(asked) == 1  # the others were not woken to ask again for room that is not there


async def test_a_request_that_finds_room_while_it_queues_gets_the_lease_not_the_refusal(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, bob, first = await _alice_holds_the_step(connect)
    alice_id = (await sync_to_async(Lease.objects.get)(pk=first.lease_id)).device_id

    def commit_meanwhile(*args: object, **kwargs: object) -> None:
        # Between bob's refusal and his place in the queue, alice's report commits the step.
        reporting.report_done(alice_id, done_for(first.lease_id))
        return None  # what park says when the room is there already

    monkeypatch.setattr(parking, "park", commit_meanwhile)
    await send(bob, LeaseRequest(samples_per_s=WHOLE_STEP, wait_s=5.0))
    answer = await receive(bob)

    assert isinstance(answer, LeaseMessage) and answer.base_version == 1


@override_settings(CROWDTRAIN_MAX_LEASE_SAMPLES=16)
async def test_a_verification_copy_wakes_a_waiting_request_of_another_volunteer(connect: Connect) -> None:
    # Steps of two leases, both Alice's: Bob's request waits for a commit that her report does not make.
    # Her lease is picked for a check; its copy needs no room, so Bob is woken and given it at once.
    await sync_to_async(make_campaign)(target_batch_size=32, staleness=0, check_fraction=1.0)
    _, tablet_token = await sync_to_async(make_device)("alice", "tablet")
    alice, alice_tablet = await greeted_agent(connect, "alice"), await greeted_agent(connect, token=tablet_token)
    bob = await greeted_agent(connect, "bob")
    leases = []
    for agent in (alice, alice_tablet):
        await send(agent, LeaseRequest(samples_per_s=WHOLE_STEP))
        leases.append(await receive(agent))
    await send(bob, LeaseRequest(samples_per_s=WHOLE_STEP, wait_s=10.0))
    held = await bob.receive_nothing(timeout=0.3)

    sketch = to_bytes([float(i % 7) for i in range(SKETCH_SIZE)])
    await send(alice, await sync_to_async(done_for)(leases[0].lease_id, sketch=sketch))
    ack = await receive(alice)
    copy = await receive(bob, timeout=3.0)  # well before his request's 10 s wait is up

    assert held and all(isinstance(lease, LeaseMessage) for lease in leases)
    assert isinstance(ack, DoneAck) and ack.accepted and ack.verification == "pending" and ack.step == 0
    assert isinstance(copy, LeaseMessage) and verify_ticket(copy.ticket, ticket_key(copy.campaign_id)).check
    assert (copy.base_version, copy.ranges) == (leases[0].base_version, leases[0].ranges)


class _FullInbox:
    """The channel layer's ``send`` refusing the first ``times`` events of one type with ChannelFull.

    On Redis every socket of a site process shares one inbox, which a busy
    process fills; this stands in for that moment, and passes every other send on.
    """

    def __init__(self, layer: Any, event_type: str, times: int) -> None:
        self.real_send, self.event_type, self.left, self.refused = layer.send, event_type, times, 0

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        if message.get("type") == self.event_type and self.left > 0:
            self.left -= 1
            self.refused += 1
            raise ChannelFull()
        await self.real_send(channel, message)


@override_settings(CROWDTRAIN_LEASE_WAIT_MAX_S=0.3)
async def test_a_waiting_requests_time_is_up_even_when_its_process_inbox_was_full(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, bob, _ = await _alice_holds_the_step(connect)
    layer = get_channel_layer()
    full = _FullInbox(layer, "lease.wait_over", times=2)
    monkeypatch.setattr(layer, "send", full.send)

    await send(bob, LeaseRequest(samples_per_s=WHOLE_STEP, wait_s=60.0))
    refusal = await receive(bob, timeout=5)

    assert full.refused == 2  # the timer's event met the full inbox twice, and was sent again
    assert isinstance(refusal, NoLease) and refusal.reason == "step_full"


async def test_a_full_inbox_of_one_waiting_socket_does_not_keep_the_commit_from_waking_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layer = get_channel_layer()
    first, second = await layer.new_channel(), await layer.new_channel()
    full = _FullInbox(layer, "lease.wake", times=1)
    monkeypatch.setattr(layer, "send", full.send)
    # One socket at a time, as the in-memory layer sends (Redis's send_many has a test of its own).
    monkeypatch.setattr(layer, "send_many", None, raising=False)

    await wake(7, [first, second])
    heard = await asyncio.wait_for(layer.receive(second), timeout=5)

    assert full.refused == 1
    assert heard["type"] == "lease.wake" and heard["campaign_id"] == 7
