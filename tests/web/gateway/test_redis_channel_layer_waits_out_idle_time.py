"""On Redis, the channel layer outlasts idle time, full inboxes and bursts of sockets coming and going.

A consumer idle past redis-py's read timeout gets its next event, a busy
process's inbox holds, and thousands of sockets leaving at once wait for a
Redis connection instead of failing.
"""

from __future__ import annotations

import asyncio

import pytest
from channels.exceptions import ChannelFull
from channels.layers import channel_layers
from django.conf import settings

from crowdtrain.gateway.channel_layer import WaitingRedisChannelLayer

# redis-py 8 gives up on a read after 5 s by default; channels_redis's blocking pop waits up to 5 s.
LONGER_THAN_REDIS_PY_DEFAULT_S = 6.0
CHANNELS_REDIS_DEFAULT_CAPACITY = 100  # per Redis list, and a process's sockets share one list


@pytest.mark.skipif(not settings.REDIS_URL, reason="the in-memory channel layer has no read timeout")
async def test_an_idle_receive_outlasts_redis_pys_default_read_timeout() -> None:
    layer = channel_layers.make_backend("default")
    channel = await layer.new_channel()

    async def send_late() -> None:
        await asyncio.sleep(LONGER_THAN_REDIS_PY_DEFAULT_S)
        await layer.send(channel, {"type": "aggregator.step", "version": 3})

    sender = asyncio.create_task(send_late())
    try:
        received = await asyncio.wait_for(layer.receive(channel), timeout=LONGER_THAN_REDIS_PY_DEFAULT_S + 10)
    finally:
        await sender
        await layer.close_pools()

    assert received == {"type": "aggregator.step", "version": 3}


@pytest.mark.skipif(not settings.REDIS_URL, reason="only channels_redis shares one inbox among a process's sockets")
async def test_a_process_inbox_holds_more_events_than_channels_redis_default_of_100() -> None:
    layer = channel_layers.make_backend("default")
    sockets = [await layer.new_channel() for _ in range(CHANNELS_REDIS_DEFAULT_CAPACITY + 50)]
    try:
        for channel in sockets:  # one pending event for each of this process's sockets
            await layer.send(channel, {"type": "lease.wake", "campaign_id": 1})
        last = await asyncio.wait_for(layer.receive(sockets[-1]), timeout=10)
    finally:
        await layer.flush()
        await layer.close_pools()

    assert last["campaign_id"] == 1


@pytest.mark.skipif(not settings.REDIS_URL, reason="the in-memory channel layer opens no connections")
async def test_sockets_leaving_all_at_once_wait_for_a_redis_connection_instead_of_failing() -> None:
    # The site's layer, with two connections for twenty sockets: as 1,000 are for 5,000 volunteers leaving.
    host = {**settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"][0], "max_connections": 2}
    layer = WaitingRedisChannelLayer(hosts=[host])
    sockets = [await layer.new_channel() for _ in range(20)]
    try:
        await asyncio.gather(*(layer.group_add("burst", channel) for channel in sockets))
        await asyncio.gather(*(layer.group_discard("burst", channel) for channel in sockets))
        pool = layer.connection(0).connection_pool
        left = await layer.connection(0).zcard(layer._group_key("burst"))
    finally:
        await layer.flush()
        await layer.close_pools()

    assert left == 0  # every socket joined and left
    assert pool.max_connections == 2


@pytest.mark.skipif(not settings.REDIS_URL, reason="send_many is the Redis layer's; the in-memory one sends each")
async def test_one_event_for_many_sockets_reaches_each_and_a_full_inbox_refuses_only_what_it_has_no_room_for() -> None:
    host = settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"][0]
    busy = WaitingRedisChannelLayer(hosts=[host], channel_capacity={"specific.*": 3})  # one process: a small inbox
    other = WaitingRedisChannelLayer(hosts=[host])  # another process, its own inbox
    busy_sockets = [await busy.new_channel() for _ in range(5)]
    other_socket = await other.new_channel()
    try:
        refused = await busy.send_many([*busy_sockets, other_socket], {"type": "lease.wake", "campaign_id": 7})
        heard = [await asyncio.wait_for(busy.receive(channel), timeout=5) for channel in busy_sockets[:3]]
        heard_elsewhere = await asyncio.wait_for(other.receive(other_socket), timeout=5)
        held = await busy.connection(0).zcard(busy.prefix + busy.non_local_name(busy_sockets[0]))
    finally:
        await busy.flush()
        await busy.close_pools()
        await other.close_pools()

    assert refused == 2  # the busy process's inbox had room for three of its five sockets
    assert heard == [{"type": "lease.wake", "campaign_id": 7}] * 3
    assert heard_elsewhere == {"type": "lease.wake", "campaign_id": 7}
    assert held == 0  # nothing more was queued for the two it refused


@pytest.mark.skipif(not settings.REDIS_URL, reason="the Redis layer's own send; the in-memory one is channels'")
async def test_a_send_to_a_full_inbox_is_refused_and_the_events_it_holds_arrive_in_order() -> None:
    host = settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"][0]
    layer = WaitingRedisChannelLayer(hosts=[host], channel_capacity={"specific.*": 2})
    first, second, third = [await layer.new_channel() for _ in range(3)]
    try:
        await layer.send(first, {"type": "lease.wake", "campaign_id": 1})
        await layer.send(second, {"type": "lease.wake", "campaign_id": 2})
        with pytest.raises(ChannelFull):
            await layer.send(third, {"type": "lease.wake", "campaign_id": 3})
        heard = [await asyncio.wait_for(layer.receive(channel), timeout=5) for channel in (first, second)]
        await layer.send(third, {"type": "lease.wake", "campaign_id": 3})  # room again
        heard.append(await asyncio.wait_for(layer.receive(third), timeout=5))
    finally:
        await layer.flush()
        await layer.close_pools()

    assert [event["campaign_id"] for event in heard] == [1, 2, 3]
