from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator

from crowdtrain.asgi import application
from crowdtrain_agent.protocol import (
    CONNECTION_HEADER,
    PROTOCOL_VERSION,
    AgentHello,
    BackboneHello,
    BackboneWelcome,
    DeviceInfo,
    decode_message,
    encode_message,
    offered_subprotocols,
)

Connect = Callable[..., Any]


async def forget_group(layer: Any, group: str) -> None:
    """What a Redis restarted empty (or channels' day-long group expiry) leaves: sockets open, their group gone."""
    if hasattr(layer, "groups"):  # the in-memory layer of the embedded default
        layer.groups.pop(group, None)
    else:  # channels_redis: the group is one sorted set
        await layer.connection(layer.consistent_hash(group)).delete(layer._group_key(group))


async def has_members(layer: Any, group: str) -> bool:
    if hasattr(layer, "groups"):
        return bool(layer.groups.get(group))
    return bool(await layer.connection(layer.consistent_hash(group)).zcard(layer._group_key(group)))


async def send(communicator: WebsocketCommunicator, message: Any) -> None:
    await communicator.send_to(text_data=encode_message(message))


async def receive(communicator: WebsocketCommunicator, timeout: float = 5) -> Any:
    return decode_message(await communicator.receive_from(timeout=timeout))


HELLO = AgentHello(
    protocol_version=PROTOCOL_VERSION, agent_version="test",
    device=DeviceInfo(kind="cpu", name="test cpu", threads=1, flops_per_s=1e9),
)  # fmt: skip


async def greeted_agent(connect: Connect, name: str = "", *, token: str = "") -> WebsocketCommunicator:
    """An agent socket past its hello: a new device's named ``name``, or the device of ``token``."""
    if not token:
        from asgiref.sync import sync_to_async

        from tests.factories import make_device

        _, token = await sync_to_async(make_device)(name)
    communicator, _, _ = await connect("/ws/agent/", token)
    await send(communicator, HELLO)
    await receive(communicator)
    return communicator


async def lease_asked_by_an_agent_of_minor(minor: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A new device's agent speaking 2.``minor`` asks for a lease: the frame it gets, then how its socket closes."""
    from asgiref.sync import sync_to_async

    from crowdtrain_agent.protocol import LeaseRequest
    from crowdtrain_agent.protocol.subprotocols import subprotocol
    from tests.factories import make_device

    _, token = await sync_to_async(make_device)()
    old = WebsocketCommunicator(
        application, "/ws/agent/", headers=[(b"authorization", f"Bearer {token}".encode())],
        subprotocols=[subprotocol(minor)],
    )  # fmt: skip
    connected, chosen = await old.connect()
    assert connected and chosen == subprotocol(minor)
    await old.send_to(text_data=encode_message(HELLO, minor))
    await old.receive_from(timeout=5)  # welcome
    await old.send_to(text_data=encode_message(LeaseRequest(), minor))
    frame = json.loads(await old.receive_from(timeout=5))
    closed = await old.receive_output(timeout=5)
    await old.disconnect()
    return frame, closed


@pytest.fixture
async def connect() -> AsyncIterator[Connect]:
    """Open sockets through the real ASGI application; all are closed after the test."""
    opened: list[WebsocketCommunicator] = []

    async def _connect(
        path: str, token: str | None, attempt: str | None = None
    ) -> tuple[WebsocketCommunicator, bool, int | None]:
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        if attempt is not None:  # the CONNECTION_HEADER our clients send
            headers.append((CONNECTION_HEADER.lower().encode(), attempt.encode()))
        # Offers this code's protocol minor, as our agent and aggregator do (2.0 peers have their own tests).
        communicator = WebsocketCommunicator(application, path, headers=headers, subprotocols=offered_subprotocols())
        connected, code = await communicator.connect()
        opened.append(communicator)
        return communicator, connected, code

    yield _connect
    for communicator in opened:
        await communicator.disconnect()


async def joined_aggregator(connect: Connect) -> tuple[WebsocketCommunicator, BackboneWelcome]:
    """An aggregator "agg-1" that said hello and was welcomed, before any campaign runs (nothing else is sent)."""
    from asgiref.sync import sync_to_async

    from tests.factories import make_aggregator

    await sync_to_async(make_aggregator)("agg-1")
    aggregator, _, _ = await connect("/ws/backbone/", "token-agg-1")
    hello = BackboneHello(
        protocol_version=PROTOCOL_VERSION, name="agg-1", upload_url="ws://x/upload", params_url="http://x/params/"
    )
    await send(aggregator, hello)
    welcome = await receive(aggregator)
    assert isinstance(welcome, BackboneWelcome)
    return aggregator, welcome
