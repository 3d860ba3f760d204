"""Aggregator orders on their Redis lane (``crowdtrain.gateway.backbone_lane``): published from any thread to
the site process that holds the aggregator's socket and written to it there, with the channel layer as the
fallback for an order that process did not hear.

Without Redis (the first pass) the lane is off and orders take the channel layer's
group, which ``test_backbone_channel`` covers; these run in the second pass.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from channels.layers import get_channel_layer
from django.conf import settings

from crowdtrain.gateway import backbone_lane
from crowdtrain.gateway.backbone_lane import holders_key, subscriber
from crowdtrain.gateway.outbox import backbone_group, publish_commits, send_event, send_outbox
from crowdtrain.scheduler.commits import Commit
from crowdtrain_agent.protocol import Heartbeat, StepCommit

from .conftest import Connect, forget_group, joined_aggregator, receive, send

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not settings.REDIS_URL, reason="the lane is Redis pub/sub; the second pass runs these"),
]

ORDER = StepCommit(campaign_id=99, step=0, lease_ids=[1, 2], num_samples=8)


async def _subscribed() -> None:
    assert subscriber.subscribed is not None
    await asyncio.wait_for(subscriber.subscribed.wait(), timeout=5)


async def _holder(aggregator_id: int) -> bytes | None:
    return await get_channel_layer().connection(0).hget(holders_key(), str(aggregator_id))


async def test_a_commit_published_by_the_committing_thread_reaches_the_aggregator_without_its_group(
    connect: Connect,
) -> None:
    aggregator, welcome = await joined_aggregator(connect)
    await _subscribed()
    await forget_group(get_channel_layer(), backbone_group(welcome.aggregator_id))  # so only the lane can carry it
    commit = Commit(ORDER, [welcome.aggregator_id])

    thread = threading.Thread(target=publish_commits, args=([commit],))
    thread.start()
    await asyncio.to_thread(thread.join)

    assert commit.delivered
    assert await receive(aggregator) == ORDER


async def test_an_order_for_an_aggregator_no_process_holds_is_not_heard(connect: Connect) -> None:
    aggregator, welcome = await joined_aggregator(connect)
    await _subscribed()

    heard = backbone_lane.publish_now([(welcome.aggregator_id + 1, send_event(ORDER))])

    assert not heard  # so the site sends it through the channel layer, which has no member for it either
    assert await aggregator.receive_nothing(timeout=0.3)


async def test_an_order_whose_holder_is_not_listening_goes_through_the_channel_layer(connect: Connect) -> None:
    aggregator, welcome = await joined_aggregator(connect)
    redis = get_channel_layer().connection(0)
    await redis.hset(holders_key(), str(welcome.aggregator_id), "ct:a-process-that-died")

    await send_outbox([(welcome.aggregator_id, ORDER)])

    assert await receive(aggregator) == ORDER


async def test_a_holder_redis_forgot_is_recorded_again_at_the_next_heartbeat(connect: Connect) -> None:
    aggregator, welcome = await joined_aggregator(connect)
    await _subscribed()
    recorded = await _holder(welcome.aggregator_id)
    await get_channel_layer().connection(0).delete(holders_key())  # what a Redis restarted empty leaves

    forgotten = backbone_lane.publish_now([(welcome.aggregator_id, send_event(ORDER))])
    await send(aggregator, Heartbeat())
    for _ in range(250):  # the heartbeat has no reply: wait until its upkeep has run
        if await _holder(welcome.aggregator_id):
            break
        await asyncio.sleep(0.02)

    assert recorded and not forgotten
    assert await _holder(welcome.aggregator_id) == recorded


async def test_a_closed_socket_is_no_longer_recorded_as_its_aggregators_holder(connect: Connect) -> None:
    aggregator, welcome = await joined_aggregator(connect)
    recorded = await _holder(welcome.aggregator_id)

    await aggregator.disconnect()

    assert recorded and await _holder(welcome.aggregator_id) is None


async def test_a_message_that_is_not_an_order_is_ignored_and_the_lane_carries_on(connect: Connect) -> None:
    aggregator, welcome = await joined_aggregator(connect)
    await _subscribed()
    await forget_group(get_channel_layer(), backbone_group(welcome.aggregator_id))
    redis = get_channel_layer().connection(0)
    holder = await _holder(welcome.aggregator_id)
    assert holder

    await redis.publish(holder, b"\xff not json")
    await redis.publish(holder, '{"aggregator": "x"}')
    await send_outbox([(welcome.aggregator_id, ORDER)])

    assert await receive(aggregator) == ORDER


async def test_the_lane_subscribes_again_after_redis_dropped_its_connection(connect: Connect) -> None:
    aggregator, welcome = await joined_aggregator(connect)
    await _subscribed()
    await forget_group(get_channel_layer(), backbone_group(welcome.aggregator_id))
    redis = get_channel_layer().connection(0)

    await redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")  # what a Redis restart does to it
    assert subscriber.subscribed is not None
    for _ in range(100):
        if not subscriber.subscribed.is_set():
            break
        await asyncio.sleep(0.02)
    await _subscribed()
    heard = backbone_lane.publish_now([(welcome.aggregator_id, send_event(ORDER))])

    assert heard
    assert await receive(aggregator) == ORDER
