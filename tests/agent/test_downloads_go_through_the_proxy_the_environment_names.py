"""The agent's HTTP client goes through the proxy HTTP_PROXY names, and not for hosts NO_PROXY lists.

urllib3 reads no proxy settings; urllib did, so a volunteer behind a proxy could log in and
download before the agent moved to the pooled client. Loopback addresses never go through one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from crowdtrain_agent import pooled_http


class _Proxy(BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_GET(self) -> None:  # a proxy is asked for the absolute URL
        type(self).seen.append(self.path)
        body = b"via the proxy"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Proxy.seen = []
    for name in ("http_proxy", "HTTP_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{server.server_address[1]}")
    yield _Proxy.seen
    server.shutdown()
    server.server_close()


def test_a_request_goes_through_the_proxy(proxy: list[str]) -> None:
    with pooled_http.get("http://site.crowdtrain.test/params/3", {}, timeout=5.0) as answer:
        assert (answer.status, answer.read()) == (200, b"via the proxy")
    assert proxy == ["http://site.crowdtrain.test/params/3"]


def test_a_host_no_proxy_lists_is_reached_directly(proxy: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("no_proxy", "site.crowdtrain.test")
    with pytest.raises(OSError):  # the name resolves nowhere: it was not handed to the proxy
        pooled_http.get("http://site.crowdtrain.test/params/3", {}, timeout=5.0)
    assert proxy == []


def test_loopback_never_goes_through_a_proxy(proxy: list[str]) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)  # stands in for a site on this machine
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pooled_http.get(f"http://127.0.0.1:{server.server_address[1]}/x", {}, timeout=5.0) as answer:
            assert answer.status == 200
        assert proxy == ["/x"]  # asked directly (a path, not the absolute URL a proxy is asked for)
    finally:
        server.shutdown()
        server.server_close()
