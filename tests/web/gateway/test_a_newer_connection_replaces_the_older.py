"""One socket per device and per aggregator: a newer connection closes the older one with 4012 and carries on.

So one token cannot hold a thousand sockets, and two agents started with the
same token learn it (4012 stops an agent, with a hint) instead of both working.
"""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async

from crowdtrain.scheduler.hotstate import presence
from crowdtrain.scheduler.models import Aggregator
from crowdtrain_agent.protocol import (
    PROTOCOL_VERSION,
    BackboneHello,
    BackboneWelcome,
    CloseCode,
    LeaseRequest,
    NoLease,
    Welcome,
)
from tests.factories import make_aggregator, make_device

from .conftest import HELLO, Connect, receive, send

pytestmark = pytest.mark.django_db(transaction=True)

BACKBONE_HELLO = BackboneHello(
    protocol_version=PROTOCOL_VERSION, name="agg-1", upload_url="ws://x/upload", params_url="http://x/params/"
)


async def test_a_second_socket_of_a_device_closes_the_first_with_4012_and_keeps_working(connect: Connect) -> None:
    _, token = await sync_to_async(make_device)()
    older, _, _ = await connect("/ws/agent/", token)
    await send(older, HELLO)
    await receive(older)

    newer, connected, _ = await connect("/ws/agent/", token)
    closed = await older.receive_output(timeout=5)
    await send(newer, HELLO)
    welcome = await receive(newer)
    await send(newer, LeaseRequest())
    answer = await receive(newer)

    assert connected
    assert closed == {"type": "websocket.close", "code": CloseCode.REPLACED}
    assert type(closed["code"]) is int
    assert isinstance(welcome, Welcome) and isinstance(answer, NoLease)
    assert await newer.receive_nothing(timeout=0.2)


async def test_sockets_of_different_devices_do_not_replace_each_other(connect: Connect) -> None:
    _, first_token = await sync_to_async(make_device)("ada")
    _, second_token = await sync_to_async(make_device)("grace")
    first, _, _ = await connect("/ws/agent/", first_token)
    await send(first, HELLO)
    await receive(first)

    second, _, _ = await connect("/ws/agent/", second_token)
    await send(second, HELLO)
    await receive(second)
    await send(first, LeaseRequest())
    answer = await receive(first)

    assert isinstance(answer, NoLease)


async def test_a_second_socket_of_an_aggregator_closes_the_first_with_4012_and_is_welcomed(connect: Connect) -> None:
    aggregator = await sync_to_async(make_aggregator)("agg-1")
    token = "token-agg-1"  # what make_aggregator issues
    older, _, _ = await connect("/ws/backbone/", token)
    await send(older, BACKBONE_HELLO)
    await receive(older)

    newer, _, _ = await connect("/ws/backbone/", token)
    await send(newer, BACKBONE_HELLO)
    welcome = await receive(newer)
    closed = await older.receive_output(timeout=5)

    assert isinstance(welcome, BackboneWelcome) and welcome.aggregator_id == aggregator.pk
    assert closed == {"type": "websocket.close", "code": CloseCode.REPLACED}


# A stale try: under load a site process acts on a handshake its client gave up on, after the client's newer
# try was welcomed (by another process, in the scale bench). It must not stop the working agent.
TRIES = "0123456789abcdef"


async def test_a_stale_try_of_the_same_agent_is_closed_and_the_newer_socket_keeps_working(connect: Connect) -> None:
    device, token = await sync_to_async(make_device)()
    newer, _, _ = await connect("/ws/agent/", token, f"{TRIES}/2")
    await send(newer, HELLO)
    await receive(newer)

    stale, _, _ = await connect("/ws/agent/", token, f"{TRIES}/1")
    closed = await stale.receive_output(timeout=5)
    await send(newer, LeaseRequest())
    answer = await receive(newer)

    assert closed == {"type": "websocket.close", "code": CloseCode.REPLACED}
    assert isinstance(answer, NoLease)
    assert await newer.receive_nothing(timeout=0.2)
    assert device.pk in presence.device_ids()  # the stale socket's close did not count the device gone


@pytest.mark.parametrize(
    ("first_try", "second_try"),
    [(f"{TRIES}/1", f"{TRIES}/2"), (f"{TRIES}/7", "fedcba9876543210/1"), (f"{TRIES}/2", "not a try")],
    ids=["a newer try of the same agent", "another agent process, whatever its number", "a malformed header"],
)
async def test_a_second_try_replaces_the_first_unless_it_is_older(
    connect: Connect, first_try: str, second_try: str
) -> None:
    _, token = await sync_to_async(make_device)()
    first, _, _ = await connect("/ws/agent/", token, first_try)
    await send(first, HELLO)
    await receive(first)

    second, _, _ = await connect("/ws/agent/", token, second_try)
    closed = await first.receive_output(timeout=5)
    await send(second, HELLO)

    assert closed == {"type": "websocket.close", "code": CloseCode.REPLACED}
    assert isinstance(await receive(second), Welcome)


async def test_a_stale_try_of_an_aggregator_is_closed_and_the_aggregator_stays_connected(connect: Connect) -> None:
    aggregator = await sync_to_async(make_aggregator)("agg-1")
    token = "token-agg-1"
    newer, _, _ = await connect("/ws/backbone/", token, f"{TRIES}/5")
    await send(newer, BACKBONE_HELLO)
    await receive(newer)
    current = await sync_to_async(lambda: Aggregator.objects.get(pk=aggregator.pk).channel_name)()

    stale, _, _ = await connect("/ws/backbone/", token, f"{TRIES}/4")
    await send(stale, BACKBONE_HELLO)
    closed = await stale.receive_output(timeout=5)
    await stale.disconnect()
    after = await sync_to_async(Aggregator.objects.get)(pk=aggregator.pk)

    assert closed == {"type": "websocket.close", "code": CloseCode.REPLACED}
    assert after.connected and after.channel_name == current
    assert await newer.receive_nothing(timeout=0.2)
