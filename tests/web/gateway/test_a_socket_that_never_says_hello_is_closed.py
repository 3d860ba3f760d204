"""A socket that does not say hello within CROWDTRAIN_HELLO_TIMEOUT_S of being accepted is told why and closed (4000).

Idle sockets that never speak used to stay open for minutes, each holding a
connection slot of the site.
"""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async

from crowdtrain_agent.protocol import CloseCode, ErrorMessage, Welcome
from tests.factories import make_aggregator, make_device

from .conftest import HELLO, Connect, receive, send

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def short_hello_timeout(settings: Any) -> None:
    settings.CROWDTRAIN_HELLO_TIMEOUT_S = 0.2


async def test_an_agent_socket_without_hello_is_told_and_closed_with_4000(connect: Connect) -> None:
    _, token = await sync_to_async(make_device)()

    communicator, connected, _ = await connect("/ws/agent/", token)
    told = await receive(communicator)
    closed = await communicator.receive_output(timeout=5)

    assert connected
    assert isinstance(told, ErrorMessage) and "no hello within 0.2 s" in told.detail
    assert closed == {"type": "websocket.close", "code": CloseCode.BAD_MESSAGE}
    assert type(closed["code"]) is int


async def test_a_backbone_socket_without_hello_is_closed_with_4000(connect: Connect) -> None:
    await sync_to_async(make_aggregator)("agg-1")

    communicator, _, _ = await connect("/ws/backbone/", "token-agg-1")
    await receive(communicator)  # the error message
    closed = await communicator.receive_output(timeout=5)

    assert closed == {"type": "websocket.close", "code": CloseCode.BAD_MESSAGE}


async def test_a_socket_that_said_hello_in_time_stays_open_past_the_deadline(connect: Connect) -> None:
    _, token = await sync_to_async(make_device)()
    communicator, _, _ = await connect("/ws/agent/", token)

    await send(communicator, HELLO)
    welcome = await receive(communicator)

    assert isinstance(welcome, Welcome)
    assert await communicator.receive_nothing(timeout=0.5)
