"""Both channels accept the WebSocket first and check the token after: a bad token is a close code, never an HTTP error.

daphne answers HTTP 403 to a handshake the application has not accepted within
its connect timeout, and a busy site's token lookup took that long: agents
read the 403 as a rejected token and quit. The close codes go out as plain
ints, which is what daphne can send (a ``CloseCode`` member made it crash and
close with 1011; ``tests/e2e/test_close_codes_through_daphne.py`` checks the
real server).
"""

from __future__ import annotations

import threading

import pytest
from asgiref.sync import sync_to_async
from django.db import OperationalError, connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from crowdtrain.accounts.models import Device
from crowdtrain.scheduler.models import Aggregator
from crowdtrain.verification import standing
from crowdtrain_agent.protocol import CloseCode, Welcome, should_reconnect
from tests.factories import make_device

from .conftest import HELLO, Connect, receive, send

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("path", ["/ws/agent/", "/ws/backbone/"])
async def test_an_unknown_token_is_accepted_then_closed_with_4001_as_a_plain_int(connect: Connect, path: str) -> None:
    communicator, connected, _ = await connect(path, "ct_not-a-real-token")

    output = await communicator.receive_output(timeout=5)

    assert connected
    assert output == {"type": "websocket.close", "code": 4001}
    assert type(output["code"]) is int


async def test_a_revoked_device_is_accepted_then_closed_with_4003_as_a_plain_int(connect: Connect) -> None:
    device, token = await sync_to_async(make_device)()
    device.revoked_at = timezone.now()
    await sync_to_async(device.save)()

    communicator, connected, _ = await connect("/ws/agent/", token)
    output = await communicator.receive_output(timeout=5)

    assert connected
    assert output == {"type": "websocket.close", "code": CloseCode.REVOKED}
    assert type(output["code"]) is int


async def test_the_socket_is_accepted_while_the_token_lookup_still_waits(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, token = await sync_to_async(make_device)()
    lookup_may_finish = threading.Event()
    authenticate = Device.authenticate

    def slow_authenticate(raw: str | None) -> Device | None:
        lookup_may_finish.wait(10)  # a database that answers late, as under load
        return authenticate(raw)

    monkeypatch.setattr(Device, "authenticate", slow_authenticate)

    try:
        communicator, connected, _ = await connect("/ws/agent/", token)
    finally:
        lookup_may_finish.set()
    await send(communicator, HELLO)
    welcome = await receive(communicator)

    assert connected
    assert isinstance(welcome, Welcome)


async def test_a_hello_sent_before_a_bad_token_was_refused_is_dropped_quietly(connect: Connect) -> None:
    communicator, _, _ = await connect("/ws/agent/", "ctd_not-a-real-token")

    await send(communicator, HELLO)  # arrives while the token is looked up; handled after the close
    output = await communicator.receive_output(timeout=5)
    await communicator.receive_nothing(timeout=0.2)

    assert output == {"type": "websocket.close", "code": CloseCode.UNAUTHORIZED}
    await communicator.disconnect()  # raises what the consumer raised, if anything


def _owner_read_without_a_query(device_id: int) -> tuple[int | None, int]:
    with CaptureQueriesContext(connection) as queries:
        owner = standing.owner_of(device_id)
    return owner, len(queries)


async def test_the_token_check_tells_the_process_the_devices_owner_which_its_reports_then_need_not_read(
    connect: Connect,
) -> None:
    device, token = await sync_to_async(make_device)()
    agent, _, _ = await connect("/ws/agent/", token)
    await send(agent, HELLO)
    await receive(agent)

    assert await sync_to_async(_owner_read_without_a_query)(device.pk) == (device.owner_id, 0)


@pytest.mark.parametrize(("path", "model"), [("/ws/agent/", Device), ("/ws/backbone/", Aggregator)])
async def test_a_token_that_cannot_be_checked_gets_4013_and_a_retry_not_a_crash(
    connect: Connect, monkeypatch: pytest.MonkeyPatch, path: str, model: type[Device] | type[Aggregator]
) -> None:
    def database_away(raw: str | None) -> None:
        raise OperationalError("terminating connection due to unexpected postmaster exit")

    monkeypatch.setattr(model, "authenticate", database_away)

    communicator, connected, _ = await connect(path, "ct_any-token")
    output = await communicator.receive_output(timeout=5)

    assert connected
    assert output == {"type": "websocket.close", "code": CloseCode.TRY_AGAIN_LATER}
    assert type(output["code"]) is int  # daphne (autobahn) refuses anything else, RFC 6455's 1013 included
    assert should_reconnect(output["code"])
