"""Aggregator orders on their Redis lane (``crowdtrain.gateway.backbone_lane``): published from any thread,
written to the aggregator's socket by the site process that holds it, with the channel layer as the fallback.

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
from crowdtrain.gateway.backbone_lane import subscriber
from crowdtrain.gateway.outbox import backbone_group, publish_commits, send_event, send_outbox
from crowdtrain.scheduler.commits import Commit
from crowdtrain_agent.protocol import StepCommit

from .conftest import Connect, forget_group, joined_aggregator, receive

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not settings.REDIS_URL, reason="the lane is Redis pub/sub; the second pass runs these"),
]

ORDER = StepCommit(campaign_id=99, step=0, lease_ids=[1, 2], num_samples=8)


async def _subscribed() -> None:
    await asyncio.wait_for(subscriber.subscribed.wait(), timeout=5)


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


async def test_orders_for_an_aggregator_this_process_does_not_hold_are_not_forwarded(connect: Connect) -> None:
    aggregator, welcome = await joined_aggregator(connect)
    await _subscribed()

    heard = backbone_lane.publish_now([(welcome.aggregator_id + 1, send_event(ORDER))])

    assert heard  # this process's subscriber heard it, and had no socket for it
    assert await aggregator.receive_nothing(timeout=0.3)


async def test_a_message_that_is_not_an_order_is_ignored_and_the_lane_carries_on(connect: Connect) -> None:
    aggregator, welcome = await joined_aggregator(connect)
    await _subscribed()
    redis = get_channel_layer().connection(0)

    await redis.publish(backbone_lane.channel(), b"\xff not json")
    await redis.publish(backbone_lane.channel(), '{"aggregator": "x"}')
    await send_outbox([(welcome.aggregator_id, ORDER)])

    assert await receive(aggregator) == ORDER


async def test_the_lane_subscribes_again_after_redis_dropped_its_connection(connect: Connect) -> None:
    aggregator, welcome = await joined_aggregator(connect)
    await _subscribed()
    await forget_group(get_channel_layer(), backbone_group(welcome.aggregator_id))
    redis = get_channel_layer().connection(0)

    await redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")  # what a Redis restart does to it
    for _ in range(100):
        if not subscriber.subscribed.is_set():
            break
        await asyncio.sleep(0.02)
    await _subscribed()
    heard = backbone_lane.publish_now([(welcome.aggregator_id, send_event(ORDER))])

    assert heard
    assert await receive(aggregator) == ORDER


async def test_an_order_no_process_heard_goes_through_the_channel_layer(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    aggregator, welcome = await joined_aggregator(connect)
    monkeypatch.setattr(backbone_lane, "channel", lambda: "ct:test:nobody-listens")

    await send_outbox([(welcome.aggregator_id, ORDER)])

    assert await receive(aggregator) == ORDER
