"""The aggregator's upload port refuses an odd subprotocol offer with HTTP 400 and its reason.

Before, 5,000 nines reached ``int()`` and the port answered 500 with a
traceback, and "crowdtrain.2.04" was accepted as "crowdtrain.2.4", a
subprotocol the client never offered.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket

import pytest

from crowdtrain_agent.protocol import PROTOCOL_MINOR, offered_subprotocols
from crowdtrain_backbone.server import BackboneServer

from .conftest import FakeSite

ODD = {
    "a superscript digit": "crowdtrain.2.³".encode(),
    "5,000 nines": b"crowdtrain.2." + b"9" * 5000,
    "a leading zero": b"crowdtrain.2.04",
    "20 offers": ", ".join(f"crowdtrain.2.{m}" for m in range(20)).encode(),
    "3,000 offers": ", ".join(f"crowdtrain.2.{m}" for m in range(3000)).encode(),
}


def _handshake(port: int, offered: bytes) -> bytes:
    """The status line and headers of the answer to one raw handshake on /upload ("" if none came)."""
    lines = [b"GET /upload HTTP/1.1", b"Host: 127.0.0.1", b"Upgrade: websocket", b"Connection: Upgrade",
             b"Sec-WebSocket-Key: " + base64.b64encode(os.urandom(16)), b"Sec-WebSocket-Version: 13",
             b"Sec-WebSocket-Protocol: " + offered]  # fmt: skip
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n")
        try:
            while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
                answer += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return answer.partition(b"\r\n\r\n")[0]


@pytest.mark.parametrize("offered", list(ODD.values()), ids=list(ODD))
async def test_an_odd_offer_gets_400_or_431_never_500(site: FakeSite, backbone: BackboneServer, offered: bytes) -> None:
    head = await asyncio.to_thread(_handshake, backbone.port, offered)

    # websockets answers 431 to a header line over its 8 KiB itself; the rest are ours, naming the offer.
    expected = b"HTTP/1.1 431" if len(offered) > 8192 else b"HTTP/1.1 400"
    assert head.startswith(expected), head


async def test_an_offer_of_ours_is_answered_with_exactly_what_was_offered(
    site: FakeSite, backbone: BackboneServer
) -> None:
    head = await asyncio.to_thread(_handshake, backbone.port, ", ".join(offered_subprotocols()).encode())

    assert head.startswith(b"HTTP/1.1 101")
    assert f"Sec-WebSocket-Protocol: crowdtrain.2.{PROTOCOL_MINOR}".encode() in head
