"""The dashboard's read of an aggregator's /metrics: figures when it answers, the reason when it does not."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from crowdtrain.ops.aggregator_probe import AggregatorProbe

METRICS = b"""# TYPE crowdtrain_backbone_pending_bytes gauge
crowdtrain_backbone_pending_bytes 1234.0
# TYPE crowdtrain_backbone_ingest_bytes_total counter
crowdtrain_backbone_ingest_bytes_total 5000000.0
"""


class _Metrics(BaseHTTPRequestHandler):
    """/metrics for the right scrape token, 401 otherwise; the tokens that came are noted."""

    tokens: list[str | None] = []

    def do_GET(self) -> None:
        token = self.headers.get("Authorization")
        self.tokens.append(token)
        status, body = (200, METRICS) if token == "Bearer scrape" and self.path == "/metrics" else (401, b"no")
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def aggregator() -> Iterator[str]:
    _Metrics.tokens = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/params"
    httpd.shutdown()
    httpd.server_close()


def test_an_answering_aggregator_shows_its_figures(aggregator: str, settings: Any) -> None:
    settings.CROWDTRAIN_METRICS_TOKEN = "scrape"

    reading = AggregatorProbe().read_all([(7, aggregator)])[7]

    assert reading["error"] == "" and reading["pending_bytes"] == 1234.0
    assert _Metrics.tokens == ["Bearer scrape"]


def test_a_refused_scrape_shows_the_status_as_before(aggregator: str, settings: Any) -> None:
    settings.CROWDTRAIN_METRICS_TOKEN = "other"

    reading = AggregatorProbe().read_all([(7, aggregator)])[7]

    assert reading["error"] == "its /metrics did not answer (HTTP Error 401: Unauthorized)"


def test_an_aggregator_that_is_gone_shows_that_it_did_not_answer() -> None:
    reading = AggregatorProbe().read_all([(7, "http://127.0.0.1:9/params")])[7]

    assert reading["error"].startswith("its /metrics did not answer (") and "refused" in reading["error"]
