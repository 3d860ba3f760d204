"""An order for a peer whose socket has just closed is dropped with a debug line, never raised into the sender.

Seen from outside: autobahn's "Attempt to send on a closed protocol" came up
through ``socket_send`` when the site sent an order to a backbone socket
that had closed a moment before.
"""

from __future__ import annotations

import logging

import pytest
from autobahn.exception import Disconnected
from daphne.ws_protocol import WebSocketProtocol

from crowdtrain.gateway.consumers import BackboneConsumer
from crowdtrain.lib import daphne_site


@pytest.mark.parametrize("state", ["STATE_CLOSING", "STATE_CLOSED"])
def test_the_sites_websocket_protocol_drops_a_send_once_closing(state: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="crowdtrain.lib.daphne_site")
    plain, site = WebSocketProtocol(), daphne_site.site_websocket_protocol()()
    for protocol in (plain, site):
        protocol.state = getattr(protocol, state)
        protocol.client_addr = ["203.0.113.9", 40000]

    with pytest.raises(Disconnected):
        plain.serverSend('{"kind":"commit"}')  # daphne's own: what reached the consumer
    site.serverSend('{"kind":"commit"}')

    assert "its WebSocket is closing" in caplog.text


async def test_a_consumer_that_closed_sends_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="crowdtrain.gateway.consumers")
    consumer = BackboneConsumer()
    sent: list[dict[str, object]] = []

    async def base_send(message: dict[str, object]) -> None:
        sent.append(message)

    consumer.base_send = base_send  # type: ignore[method-assign]
    consumer.closed = True

    await consumer.socket_send({"type": "socket.send", "text": '{"kind":"commit"}'})

    assert sent == []
    assert "not sent, the socket is closing" in caplog.text
