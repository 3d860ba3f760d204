"""The site's daphne has autobahn name things in its per-frame debug lines without click's colours."""

from __future__ import annotations

import pprint

import pytest
from autobahn.twisted import websocket as twisted_websocket
from autobahn.websocket import protocol

from crowdtrain.lib import patches


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (twisted_websocket, protocol):
        monkeypatch.setattr(module, "hltype", module.hltype)
        monkeypatch.setattr(module, "hlval", module.hlval)
    monkeypatch.setattr(protocol, "pformat", protocol.pformat)


def test_frame_debug_names_are_plain_text(restored: None) -> None:
    method = protocol.WebSocketProtocol.sendData
    assert "\x1b[" in protocol.hltype(method), "autobahn colours them by itself (click is installed)"

    patches.plain_debug_names()

    for module in (twisted_websocket, protocol):
        assert module.hltype(method) == "<WebSocketProtocol.sendData>"
        assert module.hlval("tcp:127.0.0.1:5000") == "tcp:127.0.0.1:5000"
        assert module.hlval(1234) == "1234"


def test_a_new_connections_settings_are_pretty_printed_only_when_the_debug_line_is_written(restored: None) -> None:
    settings = [("autoPingInterval", 0, "WebSocketServerFactory"), ("openHandshakeTimeout", 5, "SiteServer")]
    assert protocol.pformat is pprint.pformat, "autobahn prints them for every connection by itself"

    patches.plain_debug_names()
    deferred = protocol.pformat(settings)

    assert not isinstance(deferred, str)  # nothing printed yet: made only if the line is formatted
    assert f"\n{deferred}" == "\n" + pprint.pformat(settings)
