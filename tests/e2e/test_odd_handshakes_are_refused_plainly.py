"""Through a real daphne: an odd handshake gets a plain 400, a deaf socket is dropped, an old agent hears why.

Found from outside, with no token: a percent-encoded superscript digit in
``Sec-WebSocket-Protocol`` answered HTTP 500 (``int('³')``), 5,000 nines
reset the connection, a raw 0xb3 byte answered 500 (daphne's ASCII decode),
and "crowdtrain.2.04" was accepted as "crowdtrain.2.4". A client that sent
heartbeats but never read was still connected after 160 s, and an agent of
protocol 1 got an error frame it took for a failed connect, so it retried
for 25 minutes instead of saying "upgrade".
"""

from __future__ import annotations

import base64
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from crowdtrain_agent.protocol import (
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    AgentHello,
    CloseCode,
    DeviceInfo,
    Heartbeat,
    encode_message,
    offered_subprotocols,
)
from crowdtrain_launcher import Site, Swarm

from .conftest import seed, service_database

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PING_S = 2.0  # the site's ping interval and timeout here; 30 s and 10 s by default
HELLO = AgentHello(
    protocol_version=PROTOCOL_VERSION, agent_version="e2e",
    device=DeviceInfo(kind="cpu", name="e2e cpu", threads=1, flops_per_s=1e9),
)  # fmt: skip


@dataclass(frozen=True)
class Running:
    site: Site
    agent_tokens: dict[str, str]


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    root = tmp_path_factory.mktemp("odd-handshakes")
    with service_database() as services:
        env = {"CROWDTRAIN_VAR_DIR": str(root / "run" / "var"), **services}
        swarm = Swarm(root / "run", env=env)
        try:
            seeded = seed(swarm, {"agents": ["deaf", "old"]}, root / "spec.json")
            ping = {"CROWDTRAIN_WS_PING_INTERVAL_S": str(PING_S), "CROWDTRAIN_WS_PING_TIMEOUT_S": str(PING_S)}
            yield Running(swarm.start_site(env=ping), seeded["agents"])
        finally:
            swarm.stop(grace_s=5.0)


def _handshake(port: int, path: str, offered: bytes | None) -> tuple[int, bytes, bytes]:
    """(HTTP status, status line and headers, body) of one raw handshake; status 0 if no answer came."""
    key = base64.b64encode(os.urandom(16))
    lines = [f"GET {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Upgrade: websocket", b"Connection: Upgrade",
             b"Sec-WebSocket-Key: " + key, b"Sec-WebSocket-Version: 13"]  # fmt: skip
    if offered is not None:
        lines.append(b"Sec-WebSocket-Protocol: " + offered)
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n")
        try:
            while chunk := sock.recv(65536):
                answer += chunk
                if answer.startswith(b"HTTP/1.1 101") and b"\r\n\r\n" in answer:
                    break  # accepted: the socket stays open
        except (ConnectionResetError, TimeoutError):
            pass
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
    return status, head, body


ODD = {
    "a percent-encoded superscript digit": b"crowdtrain.2.%C2%B3",
    "5,000 nines": b"crowdtrain.2." + b"9" * 5000,
    "a raw 0xb3 byte": b"crowdtrain.2.\xb3",
    "a leading zero": b"crowdtrain.2.04",
    "20 offers": ", ".join(f"crowdtrain.2.{m}" for m in range(20)).encode(),
    "3,000 offers": ", ".join(f"crowdtrain.2.{m}" for m in range(3000)).encode(),
}


@pytest.mark.parametrize("path", ["/ws/agent/", "/ws/backbone/"])
@pytest.mark.parametrize("offered", list(ODD.values()), ids=list(ODD))
def test_an_odd_subprotocol_offer_gets_400_not_500_or_a_reset(running: Running, path: str, offered: bytes) -> None:
    status, head, body = _handshake(running.site.port, path, offered)

    # A header line over twisted's 16 KiB gets 431; every other refusal is a 400 naming the offer.
    assert status == (431 if len(offered) > 16384 else 400), head
    log = running.site.child.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "invalid literal" not in log and "Exceeds the limit" not in log


def test_an_offer_of_ours_is_answered_with_exactly_what_was_offered(running: Running) -> None:
    offered = ", ".join(offered_subprotocols()).encode()

    status, head, _ = _handshake(running.site.port, "/ws/agent/", offered)

    assert status == 101
    assert f"Sec-WebSocket-Protocol: crowdtrain.2.{PROTOCOL_MINOR}".encode() in head


def _masked_text(text: str) -> bytes:
    """One client text frame (RFC 6455: FIN, opcode 1, masked), for a client that is only a socket."""
    payload, mask = text.encode(), os.urandom(4)
    size = len(payload)
    length = bytes([0x80 | size]) if size < 126 else bytes([0x80 | 126]) + size.to_bytes(2, "big")
    return bytes([0x81]) + length + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def test_a_socket_that_sends_but_never_reads_is_dropped_within_the_ping_timeout(running: Running) -> None:
    # A raw socket: a library client would answer the site's pings from a thread of its own.
    token = running.agent_tokens["deaf"]
    key = base64.b64encode(os.urandom(16))
    request = (b"GET /ws/agent/ HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               b"Sec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\n"
               b"Authorization: Bearer " + token.encode() + b"\r\n\r\n")  # fmt: skip
    with socket.create_connection(("127.0.0.1", running.site.port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(1)  # the handshake's answer only, not a byte of what follows
        assert answer.startswith(b"HTTP/1.1 101"), answer
        sock.sendall(_masked_text(encode_message(HELLO)))
        started = time.monotonic()
        deadline = started + 2 * PING_S + 10  # a ping, its timeout, and daphne's 4 s walk, with room
        dropped_after: float | None = None
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:  # it keeps talking (heartbeats), so only an unanswered ping can tell it is deaf
                sock.sendall(_masked_text(encode_message(Heartbeat())))
            except OSError:  # the site aborted the connection (RST): the send fails
                dropped_after = time.monotonic() - started
                break

    assert dropped_after is not None, "the site kept a socket that answered no ping"


def test_an_agent_of_protocol_1_hears_only_a_close_it_stops_on(running: Running) -> None:
    # What a 1.x agent does: no subprotocol, a hello of version 1, then it reads one frame as its welcome.
    hello = encode_message(HELLO).replace(f'"protocol_version":{PROTOCOL_VERSION}', '"protocol_version":1')
    assert '"protocol_version":1' in hello
    with connect(
        running.site.url.replace("http://", "ws://", 1) + "/ws/agent/",
        additional_headers={"Authorization": f"Bearer {running.agent_tokens['old']}"},
    ) as ws:
        ws.send(hello)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)  # a frame here (the old error frame) is what made 1.x agents retry for ever

    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == CloseCode.UNSUPPORTED_VERSION
    assert "upgrade crowdtrain-agent" in closed.value.rcvd.reason
