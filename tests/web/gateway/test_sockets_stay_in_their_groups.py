"""Sockets are added to their channel-layer groups again while they stay open (``crowdtrain.gateway.groups``).

A Redis restarted empty forgets every group, and channels' layers drop a
member a day after it joined; an agent left running for days must still be
replaced by its device's newer connection (4012) and still hear its campaign.
Run on the in-memory layer (first pass) and on channels_redis (second pass).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.conf import settings

from crowdtrain.accounts.models import Device
from crowdtrain.gateway import groups
from crowdtrain.gateway.channel_layer import MARK_KEY
from crowdtrain.gateway.groups import REFRESH_S, Memberships, memberships
from crowdtrain.gateway.housekeeping import housekeeping
from crowdtrain.gateway.outbox import device_group
from crowdtrain_agent.protocol import CloseCode
from tests.factories import make_device

from .conftest import HELLO, Connect, forget_group, has_members, receive, send

pytestmark = pytest.mark.django_db(transaction=True)


async def _greeted_device(connect: Connect) -> tuple[Device, str, WebsocketCommunicator]:
    """A device, its token, and its agent's socket, welcomed (and so in its device group)."""
    device, token = await sync_to_async(make_device)()
    agent, _, _ = await connect("/ws/agent/", token)
    await send(agent, HELLO)
    await receive(agent)
    return device, token, agent


def _a_round_later() -> float:
    return time.monotonic() + REFRESH_S + 1


async def test_a_device_whose_group_was_forgotten_is_replaced_by_its_newer_socket_after_a_refresh(
    connect: Connect,
) -> None:
    device, token, older = await _greeted_device(connect)
    layer = get_channel_layer()
    await forget_group(layer, device_group(device.pk))

    refreshed = await memberships.refresh(layer, now=_a_round_later())
    newer, _, _ = await connect("/ws/agent/", token)
    closed = await older.receive_output(timeout=5)

    assert refreshed >= 1
    assert closed == {"type": "websocket.close", "code": CloseCode.REPLACED}


async def test_without_the_refresh_a_forgotten_group_lets_two_sockets_of_one_device_stay_open(
    connect: Connect,
) -> None:
    """The failure the refresh mends, shown on the same layer: nothing else re-adds the socket."""
    device, token, older = await _greeted_device(connect)
    await forget_group(get_channel_layer(), device_group(device.pk))

    await connect("/ws/agent/", token)

    assert await older.receive_nothing(timeout=0.3)


async def test_a_socket_that_closed_is_not_added_back_by_the_refresh(connect: Connect) -> None:
    device, _, agent = await _greeted_device(connect)
    await agent.disconnect()
    layer = get_channel_layer()

    await memberships.refresh(layer, now=_a_round_later())

    assert not await has_members(layer, device_group(device.pk))


async def _three_joined(layer: Any, prefix: str) -> tuple[Memberships, list[str], float]:
    """Three new channels, each joined to its own group (``prefix``.0 to .2), and when they joined."""
    kept = Memberships()
    channels = [await layer.new_channel() for _ in range(3)]
    for number, channel in enumerate(channels):
        await kept.join(layer, f"{prefix}.{number}", channel)
    return kept, channels, time.monotonic()


async def test_the_refresh_takes_only_memberships_that_are_due_and_adds_them_with_a_fresh_time() -> None:
    layer = get_channel_layer()
    kept, channels, joined = await _three_joined(layer, "test.groups")

    early = await kept.refresh(layer, now=joined + REFRESH_S / 2)
    await forget_group(layer, "test.groups.1")
    later = await kept.refresh(layer, now=joined + REFRESH_S + 1)
    again = await kept.refresh(layer, now=joined + REFRESH_S + 2)

    assert (early, later, again) == (0, 3, 0)
    assert await has_members(layer, "test.groups.1")
    assert abs(await _added_at(layer, "test.groups.1", channels[1]) - time.time()) < 5
    for number, channel in enumerate(channels):
        await kept.leave(layer, f"test.groups.{number}", channel)
    assert len(kept) == 0


async def _added_at(layer: Any, group: str, channel: str) -> float:
    """When the layer last added ``channel`` to ``group`` (the time its day-long expiry counts from)."""
    if hasattr(layer, "groups"):
        return float(layer.groups[group][channel])
    redis = layer.connection(layer.consistent_hash(group))
    key = layer._group_key(group)
    assert 0 < await redis.ttl(key) <= layer.group_expiry  # the group's key expires as channels_redis sets it
    return float(await redis.zscore(key, channel))


async def test_the_housekeeping_round_puts_a_connected_device_back_in_its_forgotten_group(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(groups, "REFRESH_S", 0.0)  # every membership is due at every round
    device, _, agent = await _greeted_device(connect)
    layer = get_channel_layer()
    await forget_group(layer, device_group(device.pk))

    await housekeeping.round()

    assert await has_members(layer, device_group(device.pk))


async def test_a_closing_sockets_memberships_are_forgotten_at_once_whatever_its_cleanup_does() -> None:
    layer = get_channel_layer()
    kept = Memberships()
    channel = await layer.new_channel()
    await kept.join(layer, "test.groups.device", channel)
    await kept.join(layer, "test.groups.campaign", channel)

    groups = kept.drop(channel)  # the cleanup's first step; its later awaits may be cancelled by daphne

    assert groups == ["test.groups.campaign", "test.groups.device"]
    assert len(kept) == 0 and await kept.refresh(layer, now=_a_round_later()) == 0


class _RedisAway:
    """A layer whose Redis does not answer, as during a restart."""

    async def group_add(self, group: str, channel: str) -> None:
        raise ConnectionError("Redis is restarting")


async def test_memberships_whose_refresh_failed_are_due_again_at_the_next_round() -> None:
    layer = get_channel_layer()
    kept = Memberships()
    channel = await layer.new_channel()
    await kept.join(layer, "test.groups.retry", channel)

    with pytest.raises(ConnectionError):
        await kept.refresh(_RedisAway(), now=_a_round_later())
    again = await kept.refresh(layer, now=time.monotonic())  # not a round later: due because the last one failed

    assert again == 1
    await kept.leave(layer, "test.groups.retry", channel)


@pytest.mark.skipif(not settings.REDIS_URL, reason="the in-memory layer lives in the process and forgets nothing")
async def test_after_redis_lost_its_groups_the_next_round_adds_every_membership_again_none_being_due() -> None:
    layer = get_channel_layer()
    kept, channels, joined = await _three_joined(layer, "test.groups.lost")
    first = await kept.refresh(layer, now=joined + 1)  # takes note of the Redis it talks to

    for number in range(3):  # a FLUSHDB, as far as these groups go: the groups and the layer's mark
        await forget_group(layer, f"test.groups.lost.{number}")
    await layer.connection(0).delete(layer.prefix + MARK_KEY)
    after_loss = await kept.refresh(layer, now=joined + 2)
    quiet = await kept.refresh(layer, now=joined + 3)

    assert (first, after_loss, quiet) == (0, 3, 0)
    for number, channel in enumerate(channels):
        assert await has_members(layer, f"test.groups.lost.{number}")
        await kept.leave(layer, f"test.groups.lost.{number}", channel)


@pytest.mark.skipif(not settings.REDIS_URL, reason="only channels_redis's groups live in a server that restarts")
async def test_a_redis_that_restarted_is_noticed_by_its_new_run_id_though_the_mark_survived() -> None:
    """A restart that loaded an older snapshot: the mark is back, groups joined since it are not."""
    layer = get_channel_layer()
    await layer.groups_forgotten()  # takes note, if no earlier test's call did
    quiet = await layer.groups_forgotten()
    run_id, mark = layer._seen[0]
    layer._seen[0] = ("an earlier run", mark)

    assert (quiet, await layer.groups_forgotten()) == (False, True)
    assert layer._seen[0] == (run_id, mark)
