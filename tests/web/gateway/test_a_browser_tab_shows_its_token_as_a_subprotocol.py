"""A browser tab cannot set ``Authorization`` on a WebSocket: it offers its token as ``crowdtrain.bearer.<token>``.

The site reads the token from that offer on ``/ws/agent/`` only, answers
with the protocol minor (never the token, which the answer would echo in the
clear), closes a wrong token with 4001 and a revoked device with 4003 as for
the header, and refuses an offer no tab makes with the reason, which never
quotes the token.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from daphne.ws_protocol import WebSocketProtocol
from django.utils import timezone

from crowdtrain.asgi import application
from crowdtrain.lib import daphne_site
from crowdtrain_agent.protocol import (
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    AgentHello,
    CloseCode,
    DeviceInfo,
    Welcome,
    bearer_subprotocol,
    encode_message,
)
from tests.factories import make_aggregator, make_device

from .conftest import receive

pytestmark = pytest.mark.django_db(transaction=True)

TAB = [f"crowdtrain.2.{PROTOCOL_MINOR}", f"crowdtrain.2.{PROTOCOL_MINOR - 1}"]  # what the page offers first
TAB_HELLO = AgentHello(
    protocol_version=PROTOCOL_VERSION, agent_version="crowdtrain-tab 0.1",
    device=DeviceInfo(kind="browser", name="Chromium tab", runtime="onnxruntime-web 1.30.0 wasm", flops_per_s=1e9),
)  # fmt: skip


_opened: list[WebsocketCommunicator] = []


@pytest.fixture(autouse=True)
async def _closed_after() -> AsyncIterator[None]:
    """Every socket a test opened is disconnected after it, so its consumer leaves its groups (closed or not)."""
    yield
    while _opened:
        await _opened.pop().disconnect()


async def tab_socket(path: str, offered: list[str], headers: list[tuple[bytes, bytes]] | None = None) -> Any:
    communicator = WebsocketCommunicator(application, path, headers=headers or [], subprotocols=offered)
    connected, chosen = await communicator.connect()
    _opened.append(communicator)
    assert connected
    return communicator, chosen


async def test_a_tab_with_its_token_offered_and_no_header_is_welcomed_and_its_runtime_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    device, token = await sync_to_async(make_device)(name="Chromium tab")

    tab, chosen = await tab_socket("/ws/agent/", [*TAB, bearer_subprotocol(token)])
    await tab.send_to(text_data=encode_message(TAB_HELLO))
    welcome = await receive(tab)

    assert chosen == f"crowdtrain.2.{PROTOCOL_MINOR}", "the answer is the minor, never the token"
    assert isinstance(welcome, Welcome) and welcome.device_id == device.pk
    await sync_to_async(device.refresh_from_db)()
    assert device.hardware["kind"] == "browser"
    assert device.hardware["runtime"] == "onnxruntime-web 1.30.0 wasm"
    assert token not in caplog.text and token[4:12] not in caplog.text


async def test_a_wrong_offered_token_closes_4001_and_a_revoked_device_4003() -> None:
    device, token = await sync_to_async(make_device)()
    device.revoked_at = timezone.now()
    await sync_to_async(device.save)()

    wrong, _ = await tab_socket("/ws/agent/", [*TAB, bearer_subprotocol("ctd_" + "x" * 43)])
    revoked, _ = await tab_socket("/ws/agent/", [*TAB, bearer_subprotocol(token)])

    assert await wrong.receive_output(timeout=5) == {"type": "websocket.close", "code": CloseCode.UNAUTHORIZED}
    assert await revoked.receive_output(timeout=5) == {"type": "websocket.close", "code": CloseCode.REVOKED}


async def test_the_header_comes_first_when_both_are_sent() -> None:
    device, token = await sync_to_async(make_device)("tab-owner")

    tab, _ = await tab_socket(
        "/ws/agent/", [*TAB, bearer_subprotocol("ctd_" + "x" * 43)], [(b"authorization", f"Bearer {token}".encode())]
    )
    await tab.send_to(text_data=encode_message(TAB_HELLO))
    welcome = await receive(tab)

    assert isinstance(welcome, Welcome) and welcome.device_id == device.pk


async def test_the_backbone_channel_does_not_read_an_offered_token() -> None:
    await sync_to_async(make_aggregator)("agg-1")

    aggregator, _ = await tab_socket("/ws/backbone/", [*TAB, bearer_subprotocol("token-agg-1")])

    assert await aggregator.receive_output(timeout=5) == {"type": "websocket.close", "code": CloseCode.UNAUTHORIZED}


@pytest.mark.parametrize(
    "offer",
    [
        "crowdtrain.bearer.",
        "crowdtrain.bearer.ctd_" + "s3cr3t" * 20,
        "crowdtrain.bearer.ctd_s3cr3t.s3cr3t",
    ],
    ids=["no token", "over-long", "a character no token has"],
)
async def test_an_odd_token_offer_is_closed_4004_with_a_reason_that_never_quotes_it(offer: str) -> None:
    tab, _ = await tab_socket("/ws/agent/", [*TAB, offer])

    closed = await tab.receive_output(timeout=5)

    assert closed["type"] == "websocket.close" and closed["code"] == CloseCode.UNSUPPORTED_VERSION
    assert "crowdtrain.bearer." in closed["reason"] and "token" in closed["reason"]
    assert "s3cr3t" not in closed["reason"]


async def test_a_browser_hello_on_a_connection_of_2_9_is_refused_with_why() -> None:
    _, token = await sync_to_async(make_device)()

    tab, chosen = await tab_socket("/ws/agent/", ["crowdtrain.2.9", bearer_subprotocol(token)])
    await tab.send_to(text_data=encode_message(TAB_HELLO, 9))
    error = json.loads(await tab.receive_from(timeout=5))
    closed = await tab.receive_output(timeout=5)

    assert chosen == "crowdtrain.2.9"
    assert error["code"] == "unsupported version" and "device.kind=browser" in error["detail"]
    assert "browser tabs" in error["detail"]
    assert closed["code"] == CloseCode.UNSUPPORTED_VERSION


class _Request:
    """What daphne's ``onConnect`` reads of a handshake: its headers and its peer."""

    def __init__(self, offered: str) -> None:
        self.headers = {"sec-websocket-protocol": offered}
        self.peer = "tcp:127.0.0.1:50000"


def test_daphne_refuses_an_odd_token_offer_with_400_before_the_site_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from autobahn.websocket.types import ConnectionDeny

    caplog.set_level(logging.INFO, logger="crowdtrain.lib.daphne_site")
    monkeypatch.setattr(WebSocketProtocol, "onConnect", lambda self, request: "passed to daphne")
    protocol = daphne_site.site_websocket_protocol()()
    token = "ctd_" + "s3cr3t" * 7 + "z"

    # The header a browser sends for ["crowdtrain.2.10", "crowdtrain.2.9", "crowdtrain.bearer.<token>"].
    assert protocol.onConnect(_Request(", ".join([*TAB, bearer_subprotocol(token)]))) == "passed to daphne"
    with pytest.raises(ConnectionDeny) as refused:
        protocol.onConnect(_Request(", ".join([*TAB, bearer_subprotocol(token * 2)])))

    reason = str(refused.value.reason)
    assert refused.value.code == 400 and "more than the 64 a device token has" in reason
    assert "s3cr3t" not in reason and "s3cr3t" not in caplog.text
