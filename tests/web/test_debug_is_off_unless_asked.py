"""DEBUG is off unless CROWDTRAIN_DEBUG asks for it, and a site started that way still serves what it served.

The default cases run Django in a child process: settings are read from the
environment once, at start-up, which is what is under test (pytest-django turns
DEBUG off in this process whatever the settings say).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from asgiref.testing import ApplicationCommunicator

ROOT = Path(__file__).resolve().parents[2]

# Asks a fresh site for a missing page from each loopback host name and for a stylesheet, and reports.
PROBE = """
import json, django
django.setup()
from django.conf import settings
from django.test import Client
client = Client()
report = {"debug": settings.DEBUG, "secure_cookies": settings.SESSION_COOKIE_SECURE,
          "mail_links": settings.ACCOUNT_DEFAULT_HTTP_PROTOCOL}
for host in ("127.0.0.1", "localhost", "[::1]"):
    response = client.get("/no-such-page/", HTTP_HOST=host)
    report[host] = [response.status_code, response.content.decode(errors="replace")[:2000]]
report["static"] = client.get("/static/css/site.css", HTTP_HOST="127.0.0.1").status_code
print(json.dumps(report))
"""


def probe(tmp_path: Path, **env: str) -> dict[str, object]:
    inherited = {name: value for name, value in os.environ.items() if not name.startswith("CROWDTRAIN_")}
    result = subprocess.run(
        [sys.executable, "-c", PROBE], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**inherited, "DJANGO_SETTINGS_MODULE": "crowdtrain.settings", "CROWDTRAIN_VAR_DIR": str(tmp_path),
             "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT / "agent" / "src"), str(ROOT)]),
             **env},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_site_started_with_nothing_set_has_debug_off(tmp_path: Path) -> None:
    report = probe(tmp_path)

    assert report["debug"] is False


def test_its_404_page_does_not_list_the_url_map(tmp_path: Path) -> None:
    report = probe(tmp_path)

    status, body = report["127.0.0.1"]  # type: ignore[misc]
    assert status == 404
    assert "URLconf" not in body and "api/" not in body


def test_it_answers_every_loopback_host_name(tmp_path: Path) -> None:
    report = probe(tmp_path)

    assert [report[host][0] for host in ("127.0.0.1", "localhost", "[::1]")] == [404, 404, 404]  # type: ignore[index]


def test_it_serves_static_files_from_their_sources_without_collectstatic(tmp_path: Path) -> None:
    report = probe(tmp_path)

    assert report["static"] == 200


def test_on_plain_http_its_cookies_and_mailed_links_stay_plain_http(tmp_path: Path) -> None:
    report = probe(tmp_path)

    assert report["secure_cookies"] is False
    assert report["mail_links"] == "http"


def test_behind_an_https_redirect_cookies_are_secure_whatever_debug_says(tmp_path: Path) -> None:
    report = probe(tmp_path, CROWDTRAIN_DEBUG="true", CROWDTRAIN_SECURE_SSL_REDIRECT="true")

    assert report["debug"] is True
    assert report["secure_cookies"] is True
    assert report["mail_links"] == "https"


@pytest.mark.django_db
async def test_the_asgi_application_serves_static_files_with_debug_off() -> None:
    from crowdtrain.asgi import application

    communicator = ApplicationCommunicator(application, {
        "type": "http", "method": "GET", "path": "/static/js/upload.js", "query_string": b"",
        "headers": [(b"host", b"127.0.0.1")], "http_version": "1.1", "scheme": "http",
    })  # fmt: skip
    await communicator.send_input({"type": "http.request", "body": b""})
    start = await communicator.receive_output(timeout=10)
    body = b""
    while True:  # a streamed file may end with a chunk that has no body at all
        chunk = await communicator.receive_output(timeout=10)
        body += chunk.get("body", b"")
        if not chunk.get("more_body"):
            break

    assert start["status"] == 200
    assert b"javascript" in {name.lower(): value for name, value in start["headers"]}[b"content-type"]
    assert body == (ROOT / "frontend" / "static" / "js" / "upload.js").read_bytes()
