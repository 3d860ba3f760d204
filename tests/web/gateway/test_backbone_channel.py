from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings

from crowdtrain.accounts.tokens import hash_token
from crowdtrain.campaigns.models import Campaign
from crowdtrain.campaigns.setup import create_campaign
from crowdtrain.gateway import backbone_lane
from crowdtrain.gateway.outbox import backbone_group, send_outbox
from crowdtrain.ops import heartbeats
from crowdtrain.scheduler import backbone
from crowdtrain.scheduler.models import Aggregator
from crowdtrain.scheduler.models import SliceAssignment as SliceRecord
from crowdtrain_agent.protocol import (
    PROTOCOL_VERSION,
    BackboneHello,
    BackboneWelcome,
    DoneAck,
    Heartbeat,
    LeaseDone,
    LeaseRequest,
    Receipt,
    SliceAssignment,
    SliceReady,
    StepApplied,
    StepCommit,
    campaign_key,
    sign_receipt,
    verify_ticket,
)
from tests.factories import TINY_GPT, make_device, make_text_dataset, make_user

from .conftest import HELLO, Connect, forget_group, has_members, joined_aggregator, receive, send

pytestmark = pytest.mark.django_db(transaction=True)


def _running_campaign() -> Campaign:
    campaign = create_campaign(
        name="c",
        owner=make_user("organizer"),
        dataset=make_text_dataset(),
        architecture="gpt",
        model_config=TINY_GPT,
        target_batch_size=8,
        microbatch_size=4,
        staleness=0,
    )
    campaign.state = Campaign.State.RUNNING
    campaign.save()
    return campaign


async def _until_ready(campaign: Campaign) -> None:
    """Wait until the site has handled ``SliceReady``: it sends no reply, and a lease asked for sooner gets none."""
    ready = SliceRecord.objects.filter(campaign=campaign, ready=True)
    for _ in range(250):
        if await ready.aexists():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the site did not mark the slice ready within 5 s")


def _aggregator(name: str) -> str:
    Aggregator.objects.create(name=name, token_hash=hash_token(f"secret-{name}"))
    return f"secret-{name}"


async def test_a_step_goes_from_agent_report_to_aggregator_commit_to_published_version(connect: Connect) -> None:
    campaign = await sync_to_async(_running_campaign)()
    token = await sync_to_async(_aggregator)("agg-1")
    aggregator, _, _ = await connect("/ws/backbone/", token)
    await send(
        aggregator,
        BackboneHello(
            protocol_version=PROTOCOL_VERSION,
            name="agg-1",
            upload_url="ws://127.0.0.1:9/upload",
            params_url="http://127.0.0.1:9/params/",
        ),
    )
    welcome = await receive(aggregator)
    assignment = await receive(aggregator)
    await send(aggregator, SliceReady(campaign_id=campaign.pk, slice_index=0, version=0))
    await _until_ready(campaign)
    _, agent_token = await sync_to_async(make_device)()
    agent, _, _ = await connect("/ws/agent/", agent_token)
    await send(agent, HELLO)
    await receive(agent)

    await send(agent, LeaseRequest())
    lease = await receive(agent)
    # The agent hands back receipts signed as the aggregator signs them: with the key its assignment carried.
    key = bytes.fromhex(assignment.ticket_key)
    ticket = verify_ticket(lease.ticket, key)
    receipt = Receipt(slice_index=0, token=sign_receipt(key, campaign_id=campaign.pk, lease_id=lease.lease_id,
                                                        slice_index=0, num_samples=lease.num_samples))  # fmt: skip
    await send(agent, LeaseDone(lease_id=lease.lease_id, receipts=[receipt], num_samples=lease.num_samples,
                                loss_sum=float(lease.num_samples), compute_s=0.1))  # fmt: skip
    ack = await receive(agent)
    commit = await receive(aggregator)
    await send(aggregator, StepApplied(campaign_id=campaign.pk, slice_index=0, step=0, version=1))
    for _ in range(100):  # handled asynchronously; a working agent is not told (its next lease names the version)
        await asyncio.sleep(0.02)
        await sync_to_async(campaign.refresh_from_db)()
        if campaign.version == 1:
            break

    # A 2.1 aggregator gets no key in the welcome, and its campaign's own key (not the site's) with the slice.
    assert isinstance(welcome, BackboneWelcome) and welcome.ticket_key == ""
    assert isinstance(assignment, SliceAssignment)
    assert key == campaign_key(settings.CROWDTRAIN_TICKET_KEY, campaign.pk) != settings.CROWDTRAIN_TICKET_KEY
    assert ticket.campaign_id == campaign.pk
    assert (assignment.start, assignment.end, assignment.version) == (0, campaign.param_count, 0)
    assert assignment.max_grad_norm > 0  # absurd gradients are refused unless the organizer opts out
    assert isinstance(ack, DoneAck) and ack.accepted
    assert isinstance(commit, StepCommit)
    assert (commit.step, commit.lease_ids, commit.num_samples) == (0, [lease.lease_id], 8)
    assert campaign.version == 1
    assert await agent.receive_nothing(timeout=0.2)


async def test_two_aggregators_split_the_parameters_between_them(connect: Connect) -> None:
    campaign = await sync_to_async(_running_campaign)()
    campaign.num_aggregators = 2
    await sync_to_async(campaign.save)()
    sockets = []

    for name in ("agg-a", "agg-b"):
        token = await sync_to_async(_aggregator)(name)
        communicator, _, _ = await connect("/ws/backbone/", token)
        await send(
            communicator,
            BackboneHello(
                protocol_version=PROTOCOL_VERSION,
                name=name,
                upload_url=f"ws://{name}/upload",
                params_url=f"http://{name}/params/",
            ),
        )
        await receive(communicator)
        sockets.append(communicator)
    # The campaign is assigned once both are live: each gets its slice then.
    assignments = [await receive(communicator) for communicator in sockets]

    spans = sorted((a.start, a.end) for a in assignments)
    assert spans[0][0] == 0 and spans[0][1] == spans[1][0] and spans[1][1] == campaign.param_count


async def test_an_aggregator_that_lost_its_state_rolls_the_campaign_back(connect: Connect) -> None:
    campaign = await sync_to_async(_running_campaign)()
    token = await sync_to_async(_aggregator)("agg-1")
    aggregator, _, _ = await connect("/ws/backbone/", token)
    await send(
        aggregator,
        BackboneHello(
            protocol_version=PROTOCOL_VERSION, name="agg-1", upload_url="ws://x/upload", params_url="http://x/params/"
        ),
    )
    await receive(aggregator)
    await receive(aggregator)
    await sync_to_async(Campaign.objects.filter(pk=campaign.pk).update)(version=3, committed_steps=3)

    await send(aggregator, SliceReady(campaign_id=campaign.pk, slice_index=0, version=0))
    for _ in range(50):  # the consumer handles it asynchronously; nothing is sent back with one slice
        await asyncio.sleep(0.05)
        await sync_to_async(campaign.refresh_from_db)()
        if campaign.version == 0:
            break

    assert (campaign.version, campaign.committed_steps) == (0, 0)


async def test_a_campaign_started_after_its_aggregator_joined_gets_its_slice_on_the_next_heartbeat(
    connect: Connect,
) -> None:
    aggregator, _ = await joined_aggregator(connect)
    campaign = await sync_to_async(_running_campaign)()

    await send(aggregator, Heartbeat())
    assignment = await receive(aggregator)

    assert isinstance(assignment, SliceAssignment) and assignment.campaign_id == campaign.pk


async def test_an_aggregator_whose_group_the_channel_layer_forgot_hears_commits_again_after_a_heartbeat(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backbone_lane, "enabled", lambda: False)  # the channel layer's way, which Redis can forget
    aggregator, welcome = await joined_aggregator(connect)
    layer = get_channel_layer()
    group = backbone_group(welcome.aggregator_id)
    await forget_group(layer, group)  # what a Redis restarted empty leaves: the socket open, its group gone
    order = StepCommit(campaign_id=99, step=0, lease_ids=[1], num_samples=4)
    await send_outbox([(welcome.aggregator_id, order)])
    assert await aggregator.receive_nothing(timeout=0.2)

    await send(aggregator, Heartbeat())
    for _ in range(500):  # the heartbeat has no reply: wait until the consumer has handled it
        if await has_members(layer, group):
            break
        await asyncio.sleep(0.01)
    await send_outbox([(welcome.aggregator_id, order)])

    assert await receive(aggregator) == order


async def test_a_steps_applied_is_handled_while_the_last_heartbeats_upkeep_still_waits(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under load the upkeep waits for the site's busy thread pools (up to 1.3 s in the scale bench): the
    ``applied`` that agents wait on must not queue behind it."""
    aggregator, welcome = await joined_aggregator(connect)
    stuck, handled = threading.Event(), threading.Event()
    calls: list[int] = []

    def aggregator_heard(aggregator_id: int) -> None:
        calls.append(aggregator_id)
        if len(calls) > 1:  # the hello's call passes; the heartbeat's waits, as for a busy pool
            stuck.wait(10)

    monkeypatch.setattr(heartbeats, "aggregator_heard", aggregator_heard)
    real_step_applied = backbone.step_applied

    def step_applied(*args: Any) -> Any:
        handled.set()
        return real_step_applied(*args)

    monkeypatch.setattr(backbone, "step_applied", step_applied)
    try:
        await send(aggregator, Heartbeat())
        await send(aggregator, StepApplied(campaign_id=99, slice_index=0, step=0, version=1))
        heard = await asyncio.to_thread(handled.wait, 5)
    finally:
        stuck.set()

    assert heard
