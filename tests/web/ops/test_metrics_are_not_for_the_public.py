"""/metrics wants the bearer token once one is configured, and otherwise only the deployment's own network:
the site's, and a committer's."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any
from wsgiref.util import setup_testing_defaults

import pytest
from django.test import Client, override_settings

from crowdtrain.ops.metrics_server import guarded_app, serve_metrics
from crowdtrain_launcher.engines import free_port

pytestmark = pytest.mark.django_db


@override_settings(CROWDTRAIN_METRICS_TOKEN="s3cret-metrics-token")
def test_with_a_token_configured_a_scrape_without_it_is_refused() -> None:
    client = Client()

    anonymous = client.get("/metrics")
    wrong = client.get("/metrics", HTTP_AUTHORIZATION="Bearer not-it")
    right = client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-metrics-token")

    assert anonymous.status_code == 401 and "CROWDTRAIN_METRICS_TOKEN" in anonymous.json()["error"]
    assert wrong.status_code == 401
    assert right.status_code == 200 and b"crowdtrain_campaigns" in right.content


@override_settings(CROWDTRAIN_METRICS_TOKEN="")
def test_without_a_token_only_unproxied_private_addresses_are_answered() -> None:
    local = Client(REMOTE_ADDR="127.0.0.1").get("/metrics")
    private = Client(REMOTE_ADDR="10.0.3.7").get("/metrics")
    public = Client(REMOTE_ADDR="93.184.216.34").get("/metrics")
    relayed = Client(REMOTE_ADDR="10.0.3.7").get("/metrics", HTTP_X_FORWARDED_FOR="203.0.113.9")

    assert (local.status_code, private.status_code) == (200, 200)
    assert (public.status_code, relayed.status_code) == (403, 403)


# However a proxy names the client it relays for; X-Forwarded-For alone let the others through.
PROXY_FORMS = [
    ("Forwarded", "for=203.0.113.9;proto=https"), ("X-Real-IP", "203.0.113.9"), ("True-Client-IP", "203.0.113.9"),
    ("CF-Connecting-IP", "203.0.113.9"), ("X-Client-IP", "203.0.113.9"), ("Via", "1.1 balancer"),
    ("X-Forwarded-Host", "crowdtrain.example"),
]  # fmt: skip


@override_settings(CROWDTRAIN_METRICS_TOKEN="")
@pytest.mark.parametrize(("header", "value"), PROXY_FORMS)
def test_without_a_token_a_request_any_proxy_relayed_is_refused(header: str, value: str) -> None:
    meta = {"HTTP_" + header.upper().replace("-", "_"): value}

    relayed = Client(REMOTE_ADDR="127.0.0.1").get("/metrics", **meta)

    assert relayed.status_code == 403, header
    assert "CROWDTRAIN_METRICS_TOKEN" in relayed.json()["error"]


@override_settings(CROWDTRAIN_METRICS_TOKEN="s3cret-metrics-token")
def test_with_the_token_a_relayed_scrape_is_answered() -> None:
    answer = Client(REMOTE_ADDR="10.0.3.7").get(
        "/metrics", HTTP_AUTHORIZATION="Bearer s3cret-metrics-token", HTTP_FORWARDED="for=203.0.113.9"
    )

    assert answer.status_code == 200


# A committer serves its own /metrics (manage.py run_committer --metrics-port), by the same rule.


def _scrape(port: int, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 (loopback http)
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@override_settings(CROWDTRAIN_METRICS_TOKEN="s3cret-metrics-token")
def test_a_committers_metrics_want_the_token_too() -> None:
    server = serve_metrics(free_port(), host="127.0.0.1")
    try:
        port = server.server_address[1]
        anonymous, wrong, right = _scrape(port), _scrape(port, "not-it"), _scrape(port, "s3cret-metrics-token")
    finally:
        server.shutdown()
        server.server_close()

    assert anonymous[0] == 401 and "CROWDTRAIN_METRICS_TOKEN" in json.loads(anonymous[1])["error"]
    assert wrong[0] == 401
    assert right[0] == 200 and b"crowdtrain_step_commit_seconds" in right[1]


@override_settings(CROWDTRAIN_METRICS_TOKEN="")
@pytest.mark.parametrize(
    ("address", "forwarded", "status"),
    [("127.0.0.1", None, "200"), ("10.0.3.7", None, "200"), ("93.184.216.34", None, "403"),
     ("10.0.3.7", "203.0.113.9", "403"), ("127.0.0.1", "for=203.0.113.9", "403")],
)  # fmt: skip
def test_without_a_token_a_committer_answers_only_unproxied_private_addresses(
    address: str, forwarded: str | None, status: str
) -> None:
    environ: dict[str, Any] = {"REMOTE_ADDR": address, "PATH_INFO": "/metrics"}
    if forwarded:  # the de facto header, or RFC 7239's
        environ["HTTP_FORWARDED" if forwarded.startswith("for=") else "HTTP_X_FORWARDED_FOR"] = forwarded
    setup_testing_defaults(environ)
    answered: list[str] = []

    body = b"".join(guarded_app()(environ, lambda line, headers: answered.append(line)))

    assert answered[0].split()[0] == status
    assert (b"crowdtrain_step_commit_seconds" in body) == (status == "200")
