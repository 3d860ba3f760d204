"""``/metrics`` for a process that serves no HTTP of its own (the committer), by the site's access rule.

prometheus_client's own server answers anyone; this one asks what the site's
``/metrics`` asks (``access.site_scrape_refusal``): the bearer token where one is
configured, else a private address.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, make_wsgi_app

from .access import site_scrape_refusal


class _QuietHandler(WSGIRequestHandler):
    def handle(self) -> None:
        try:
            super().handle()
        finally:
            # The site's collector reads the database in this thread: no connection is kept between scrapes.
            from django.db import connections

            connections.close_all()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        """A scrape every 15 s is not news."""


def guarded_app() -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
    """prometheus_client's WSGI app for the process's default registry, behind the site's access rule."""
    metrics = make_wsgi_app(REGISTRY)

    def app(request: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        """``request``: the WSGI environ of one scrape (its headers, not the process's environment)."""
        headers = [key for key in request if key.startswith("HTTP_")]
        refused = site_scrape_refusal(request.get("HTTP_AUTHORIZATION"), headers, request.get("REMOTE_ADDR") or "")
        if refused is None:
            return metrics(request, start_response)
        status, message = refused
        start_response(f"{status} {HTTPStatus(status).phrase}", [("Content-Type", "application/json")])
        return [json.dumps({"error": message}).encode()]

    return app


def serve_metrics(port: int, host: str = "0.0.0.0") -> WSGIServer:  # noqa: S104 (scraped from the deployment's network)
    """Serve ``/metrics`` on ``port`` from a daemon thread; returns the server (``shutdown()`` stops it)."""
    server = make_server(host, port, guarded_app(), handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="crowdtrain-metrics", daemon=True).start()
    return server
