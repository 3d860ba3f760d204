"""Serve the site's ASGI application on daphne, with the site's WebSocket rules and start-up checks.

    python -m crowdtrain.lib.daphne_site -b 0.0.0.0 -p 8000 [more daphne options]

Every way the site is served (``manage.py serve``, the launcher's swarms and
``make cluster``, ``deploy/compose.yaml``) starts daphne through here, so they
share one keepalive, one way of refusing odd handshakes, one thread pool and
the patches of ``crowdtrain.lib.patches`` (which lists each, with its figure).
Options given on the command line come after ours, so they win.
"""

from __future__ import annotations

import gc
import importlib
import io
import logging
import math
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from crowdtrain.lib.patches import PacedWalks, apply_all

APPLICATION = "crowdtrain.asgi:application"
logger = logging.getLogger(__name__)
DAPHNE_PINGS_OFF_S = 10**9  # daphne's --ping-interval: no socket is that old, so daphne never pings


def site_websocket_protocol() -> type:
    """daphne's WebSocket protocol, refusing odd handshakes plainly and keeping a close's reason.

    daphne decoded a stranger's ``Sec-WebSocket-Protocol`` and crashed with
    HTTP 500 on a non-ASCII byte or a percent-encoded "³"; here the offer is
    checked first (``crowdtrain_agent.protocol.choose_subprotocol``) and an odd
    one gets 400 with the reason. daphne sends a close's code alone, and
    autobahn raised "Attempt to send on a closed protocol" into a consumer that
    sent to a closing socket; here the reason goes out and such a send is dropped.
    """
    from autobahn.websocket.types import ConnectionDeny
    from daphne.ws_protocol import WebSocketProtocol

    from crowdtrain_agent.protocol import SubprotocolError, choose_subprotocol, subprotocols_in_header

    class SiteWebSocketProtocol(WebSocketProtocol):
        refused = False  # refused in onConnect: daphne never registered the connection, so it has no close to note

        def onConnect(self, request: Any) -> Any:
            offered = request.headers.get("sec-websocket-protocol")
            if offered is not None:
                try:
                    choose_subprotocol(subprotocols_in_header(offered))
                except SubprotocolError as exc:
                    self.refused = True
                    logger.info("refused a WebSocket handshake from %s: %s", request.peer, exc)
                    raise ConnectionDeny(ConnectionDeny.BAD_REQUEST, str(exc)) from None
            return super().onConnect(request)

        def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:  # noqa: N803 (autobahn's)
            if not self.refused:
                super().onClose(wasClean, code, reason)

        def handle_reply(self, message: dict[str, Any]) -> None:
            if message.get("type") == "websocket.close" and self.state != self.STATE_CONNECTING:
                # daphne drops a close's reason, where the protocol's refusals say what to do next.
                code = message.get("code")
                self.sendClose(code=1000 if code is None else code, reason=message.get("reason") or None)
                return
            super().handle_reply(message)

        def serverSend(self, content: str | bytes, binary: bool = False) -> None:  # noqa: FBT001, FBT002 (daphne's)
            if self.state in (self.STATE_CLOSING, self.STATE_CLOSED):
                # An order for a peer whose socket closed a moment ago: nothing to tell it any more.
                logger.debug("not sent to %s: its WebSocket is closing", self.client_addr)
                return
            super().serverSend(content, binary)

    return SiteWebSocketProtocol


LONG_LINE_ANSWER = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"
    b"A request line or header line is too long; no client of this site sends one that long.\n"
)


def answer_long_lines(channel: Any) -> None:
    """Have twisted's HTTP channel answer 431 to a line over its limit (16 KiB), where it just hung up."""

    def refuse(_line: bytes) -> None:
        channel.transport.write(LONG_LINE_ANSWER)
        channel.transport.loseConnection()

    channel.lineLengthExceeded = refuse


def server_class() -> type:
    """daphne's ``Server`` with the site's WebSocket protocol, keepalive and 431 answer, its walks paced.

    Keepalive: every WebSocket is pinged every ``CROWDTRAIN_WS_PING_INTERVAL_S``
    and dropped when its pong is later than ``CROWDTRAIN_WS_PING_TIMEOUT_S``,
    busy or not (``autoPingRestartOnAnyTraffic`` off): daphne's own pings only
    reach sockets that have sent nothing for a while, so a client that kept
    sending but never read, its replies piling up in the site's buffers, was
    never asked. Pacing: ``crowdtrain.lib.patches.PacedWalks``.

    Built on call: importing daphne's server installs twisted's asyncio
    reactor, which only a process that is about to serve should do.
    """
    from daphne.server import Server
    from django.conf import settings

    protocol = site_websocket_protocol()

    class SiteServer(PacedWalks, Server):
        _ws_factory: Any = None
        _http_factory: Any = None

        # daphne makes its factory in run() and listens at once: the only moment to give it ours.
        @property
        def ws_factory(self) -> Any:
            return self._ws_factory

        @ws_factory.setter
        def ws_factory(self, factory: Any) -> None:
            factory.protocol = protocol
            factory.setProtocolOptions(
                autoPingInterval=settings.CROWDTRAIN_WS_PING_INTERVAL_S, autoPingRestartOnAnyTraffic=False
            )
            self._ws_factory = factory

        @property
        def http_factory(self) -> Any:
            return self._http_factory

        @http_factory.setter
        def http_factory(self, factory: Any) -> None:
            build = factory.buildProtocol

            def build_protocol(addr: Any) -> Any:
                built = build(addr)
                # twisted wraps its HTTPChannel to negotiate HTTP/2; the line limit is the channel's.
                answer_long_lines(getattr(built, "_channel", built))
                return built

            factory.buildProtocol = build_protocol
            self._http_factory = factory

    return SiteServer


def keepalive_args() -> list[str]:
    """daphne's keepalive options: its own pings off, autobahn's timeout (which daphne sets) from the settings."""
    from django.conf import settings

    # daphne takes whole seconds only: a fractional setting is rounded up.
    timeout = math.ceil(settings.CROWDTRAIN_WS_PING_TIMEOUT_S)
    return ["--ping-interval", str(DAPHNE_PINGS_OFF_S), "--ping-timeout", str(timeout)]


def refuse_failed_checks() -> None:
    """Run Django's system checks, as ``manage.py`` commands do, and exit on an error before listening.

    daphne runs none itself, and every way of serving the site comes through here:
    a setting that cannot work (``crowdtrain.checks``) stops the process with the check's
    message and hint instead of failing later, one request or one aggregator at a time.
    """
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError

    try:
        call_command("check", stdout=io.StringIO())  # warnings still reach stderr
    except SystemCheckError as exc:
        sys.exit(f"crowdtrain: the site cannot start with these settings.\n{exc}")


def use_scheduler_threads() -> ThreadPoolExecutor:
    """Give the loop daphne serves a default executor of ``CROWDTRAIN_SCHEDULER_THREADS`` threads; returns it."""
    from daphne.server import twisted_loop
    from django.conf import settings

    pool = ThreadPoolExecutor(
        # 0: ThreadPoolExecutor's own size, min(32, cores + 4), as asyncio's default executor has
        max_workers=settings.CROWDTRAIN_SCHEDULER_THREADS or None,
        thread_name_prefix="crowdtrain-scheduler",
    )
    twisted_loop.set_default_executor(pool)
    return pool


def main(argv: Sequence[str] | None = None) -> Any:
    """Serve ``crowdtrain.asgi:application`` with daphne's command line (``argv`` without the application)."""
    from daphne.cli import CommandLineInterface

    importlib.import_module(APPLICATION.partition(":")[0])  # daphne finds it loaded
    refuse_failed_checks()
    use_scheduler_threads()
    apply_all()
    # What start-up loaded (Django, the app) leaves the collector: its full passes scan only what connections made.
    gc.freeze()
    cli = CommandLineInterface()
    cli.server_class = server_class()
    args = list(sys.argv[1:] if argv is None else argv)
    return cli.run([*keepalive_args(), *args, APPLICATION])


if __name__ == "__main__":
    main()
