"""The site's daphne has autobahn name things in its per-frame debug lines without click's colours."""

from __future__ import annotations

import pytest
from autobahn.twisted import websocket as twisted_websocket
from autobahn.websocket import protocol

from crowdtrain import daphne_site


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (twisted_websocket, protocol):
        monkeypatch.setattr(module, "hltype", module.hltype)
        monkeypatch.setattr(module, "hlval", module.hlval)


def test_frame_debug_names_are_plain_text(restored: None) -> None:
    method = protocol.WebSocketProtocol.sendData
    assert "\x1b[" in protocol.hltype(method), "autobahn colours them by itself (click is installed)"

    daphne_site.plain_debug_names()

    for module in (twisted_websocket, protocol):
        assert module.hltype(method) == "<WebSocketProtocol.sendData>"
        assert module.hlval("tcp:127.0.0.1:5000") == "tcp:127.0.0.1:5000"
        assert module.hlval(1234) == "1234"
