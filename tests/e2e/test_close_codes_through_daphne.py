"""Through a real daphne, refused credentials reach clients as the protocol's close codes, and the programs stop.

The consumers' tests run without daphne, which is why nobody saw that daphne
could send none of them: it crashed on the ``CloseCode`` enum and closed with
1011, and an agent or aggregator with a bad token retried for ever.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect
from websockets.typing import Subprotocol

from crowdtrain_agent import login
from crowdtrain_agent.protocol import (
    PROTOCOL_VERSION,
    AgentHello,
    CloseCode,
    DeviceInfo,
    Welcome,
    bearer_subprotocol,
    decode_message,
    encode_message,
    offered_subprotocols,
    should_reconnect,
)
from crowdtrain_launcher import Site, Swarm

from .conftest import seed, service_database

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HELLO = AgentHello(
    protocol_version=PROTOCOL_VERSION, agent_version="e2e",
    device=DeviceInfo(kind="cpu", name="e2e cpu", threads=1, flops_per_s=1e9),
)  # fmt: skip
EXITS_WITHIN_S = 30.0  # it used to retry for 25 minutes; starting Python and torch takes a few seconds


@dataclass(frozen=True)
class Running:
    swarm: Swarm
    site: Site
    agent_tokens: dict[str, str]

    @property
    def ws_url(self) -> str:
        return self.site.url.replace("http://", "ws://", 1)


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """One site on daphne for the whole file: seeding and starting it is the slow part."""
    root = tmp_path_factory.mktemp("close-codes")
    with service_database() as services:
        swarm = Swarm(root / "run", env={"CROWDTRAIN_VAR_DIR": str(root / "run" / "var"), **services})
        try:
            seeded = seed(swarm, {"agents": ["revoked", "twice", "crowded", "tab"]}, root / "spec.json")
            yield Running(swarm, swarm.start_site(), seeded["agents"])
        finally:
            swarm.stop(grace_s=5.0)


def _close_code(ws: ClientConnection) -> int | None:
    try:
        while True:
            ws.recv(timeout=10)
    except ConnectionClosed as closed:
        return closed.rcvd.code if closed.rcvd is not None else None


def _hello(ws: ClientConnection) -> Any:
    ws.send(encode_message(HELLO))
    return decode_message(ws.recv(timeout=10))


def _site_log(running: Running) -> str:
    return running.site.child.log_path.read_text(errors="replace")


@pytest.mark.parametrize("path", ["/ws/agent/", "/ws/backbone/"])
def test_an_unknown_token_is_closed_with_4001_not_1011(running: Running, path: str) -> None:
    with connect(running.ws_url + path, additional_headers={"Authorization": "Bearer ct_unknown"}) as ws:
        code = _close_code(ws)

    assert code == CloseCode.UNAUTHORIZED
    assert "must be an integer" not in _site_log(running)


def test_a_revoked_device_is_closed_with_4003(running: Running) -> None:
    token = running.agent_tokens["revoked"]
    assert login.revoke(running.site.url, token)

    with connect(running.ws_url + "/ws/agent/", additional_headers={"Authorization": f"Bearer {token}"}) as ws:
        code = _close_code(ws)

    assert code == CloseCode.REVOKED


def test_a_second_socket_on_one_token_closes_the_first_with_4012(running: Running) -> None:
    headers = {"Authorization": f"Bearer {running.agent_tokens['twice']}"}
    with connect(running.ws_url + "/ws/agent/", additional_headers=headers) as older:
        assert isinstance(_hello(older), Welcome)

        with connect(running.ws_url + "/ws/agent/", additional_headers=headers) as newer:
            code = _close_code(older)
            welcome = _hello(newer)

    assert code == CloseCode.REPLACED
    assert isinstance(welcome, Welcome)


def test_a_saturated_site_turns_a_new_socket_away_with_4013_and_keeps_the_one_it_has(running: Running) -> None:
    # A second site process on the same database, allowed one socket: RFC 6455's 1013 crashed daphne's side.
    crowded = running.swarm.start_site(name="site-one-socket", env={"CROWDTRAIN_MAX_SOCKETS": "1"}, worker=False)
    url = crowded.url.replace("http://", "ws://", 1) + "/ws/agent/"
    headers = {"Authorization": f"Bearer {running.agent_tokens['crowded']}"}
    with connect(url, additional_headers=headers) as first:
        assert isinstance(_hello(first), Welcome)
        with connect(url, additional_headers=headers) as second:
            code = _close_code(second)
        still_there = first.ping().wait(timeout=10)  # the socket it kept still answers

    assert code == CloseCode.TRY_AGAIN_LATER
    assert should_reconnect(code)
    assert still_there
    assert "invalid close code" not in crowded.child.log_path.read_text(errors="replace")


def test_the_agent_with_an_unknown_token_exits_at_once_saying_to_log_in_again(running: Running) -> None:
    started = time.monotonic()

    agent = running.swarm.start_agent(running.site, token="ctd_unknown", name="agent-unknown-token")
    status = agent.popen.wait(timeout=EXITS_WITHIN_S)

    assert status == 1, agent.log_tail()
    assert time.monotonic() - started < EXITS_WITHIN_S
    assert "rejected this agent's token (close code 4001)" in agent.log_tail()
    assert "log in again" in agent.log_tail()


def test_the_aggregator_with_an_unknown_token_exits_saying_how_to_get_one(running: Running) -> None:
    running.swarm.start_aggregator(running.site, token="ctb_unknown", name="agg-unknown-token")
    aggregator = running.swarm.children[-1]

    status = aggregator.popen.wait(timeout=EXITS_WITHIN_S)

    assert status == 1, aggregator.log_tail()
    assert "manage.py create_backbone_token --name agg-unknown-token" in aggregator.log_tail()


def _tab(running: Running, token: str) -> ClientConnection:
    """A socket as a browser tab opens it: no Authorization header, its token offered after its minors."""
    offered = [Subprotocol(p) for p in [*offered_subprotocols(), bearer_subprotocol(token)]]
    return connect(running.ws_url + "/ws/agent/", subprotocols=offered)


def test_a_tab_that_offers_its_token_as_a_subprotocol_is_welcomed_and_refused_as_with_the_header(
    running: Running,
) -> None:
    token = running.agent_tokens["tab"]
    tab_hello = AgentHello(
        protocol_version=PROTOCOL_VERSION, agent_version="e2e tab",
        device=DeviceInfo(kind="browser", name="e2e tab", runtime="onnxruntime-web 1.30.0 wasm"),
    )  # fmt: skip

    with _tab(running, token) as ws:
        chosen = ws.subprotocol
        ws.send(encode_message(tab_hello))
        welcome: Any = decode_message(ws.recv(timeout=10))
    with _tab(running, "ctd_" + "x" * 43) as ws:
        wrong = _close_code(ws)
    with pytest.raises(InvalidStatus) as refused:
        _tab(running, token + "x" * 64)

    assert chosen == offered_subprotocols()[0], "the answer is the minor, never the token"
    assert isinstance(welcome, Welcome)
    assert wrong == CloseCode.UNAUTHORIZED
    assert refused.value.response.status_code == 400
    assert "a device token has" in refused.value.response.reason_phrase  # daphne says why in its status line
    assert token[4:] not in _site_log(running)
