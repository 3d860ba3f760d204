"""Login's HTTP: a redirect is reported, never followed with the token; no answer at all says "cannot reach"."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from crowdtrain_agent import login


class _Moved(BaseHTTPRequestHandler):
    """Every path but /elsewhere answers 301 to /elsewhere; each request's path and token are noted."""

    seen: list[tuple[str, str, str | None]] = []

    def _answer(self) -> None:
        self.seen.append((self.command, self.path, self.headers.get("Authorization")))
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        if self.path == "/elsewhere":
            body = b'{"error": "followed"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(301)
        self.send_header("Location", f"http://127.0.0.1:{self.server.server_address[1]}/elsewhere")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = _answer
    do_POST = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def moved() -> Iterator[str]:
    _Moved.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Moved)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_redirected_login_says_which_address_to_use_and_sends_nothing_there(moved: str) -> None:
    with pytest.raises(login.LoginError, match=r"redirects to http://127\.0\.0\.1:\d+/elsewhere; pass the site's "):
        login.request_code(moved, "lab gpu", {})

    assert _Moved.seen == [("POST", "/api/device/code", None)]


def test_a_redirected_whoami_does_not_resend_the_token(moved: str) -> None:
    with pytest.raises(login.LoginError, match="final address as --server"):
        login.whoami(moved, "ctd_secret")

    assert _Moved.seen == [("GET", "/api/me", "Bearer ctd_secret")]


def test_a_site_that_does_not_answer_is_unreachable_with_the_address() -> None:
    with pytest.raises(login.SiteUnreachable, match=r"^cannot reach http://127\.0\.0\.1:9/api/me: .+"):
        login.whoami("http://127.0.0.1:9", "ctd_secret")
