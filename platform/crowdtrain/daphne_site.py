"""Run the site's ASGI application on daphne, with housekeeping paced for thousands of quiet sockets.

    python -m crowdtrain.daphne_site -b 0.0.0.0 -p 8000 [more daphne options]

Every way the site is served (``manage.py serve``, the launcher's swarms and
``make cluster``, ``deploy/compose.yaml``) starts daphne through here, so they
share two choices:

- **Keepalive** (``SiteWebSocketProtocol``): every WebSocket is pinged
  every ``CROWDTRAIN_WS_PING_INTERVAL_S`` seconds and dropped when it has not
  answered within ``CROWDTRAIN_WS_PING_TIMEOUT_S``, busy or not: only a pong
  counts (autobahn's keepalive, with ``autoPingRestartOnAnyTraffic`` off).
  daphne's own pings only sockets that have sent nothing for a while, so a
  client that kept sending but never read (its replies piling up in the
  site's buffers) was never asked; it is switched off with an interval no
  socket reaches (``DAPHNE_PINGS_OFF_S``). A socket that never says hello is
  closed sooner, by the consumers (``CROWDTRAIN_HELLO_TIMEOUT_S``).
- **Handshakes refused plainly** (``SiteWebSocketProtocol``): the
  ``Sec-WebSocket-Protocol`` header a stranger sends is checked
  (``crowdtrain_agent.protocol.choose_subprotocol``) before daphne decodes
  it, which crashed with HTTP 500 on a non-ASCII byte or a percent-encoded
  "³": an odd offer gets HTTP 400 with the reason instead, and a header line
  over twisted's 16 KiB gets 431 (twisted hung up without a word). A close keeps
  its reason (daphne sends the code alone), and a message for a socket that
  is closing is dropped with a debug line (autobahn raised "Attempt to send
  on a closed protocol" into the consumer that sent it).
- **Walks** (``SiteServer``): daphne walks every connection once a second to
  reap finished application instances, and every 2 s to check timeouts and
  send keepalive pings. With 5,000 idle volunteers on a process those walks
  cost it more than their heartbeats did; here they run every
  ``REAP_EVERY_S`` and ``TIMEOUTS_EVERY_S`` seconds, so a closed socket's
  record lingers a few seconds longer and a ping or a handshake timeout is
  up to 2 s later, which the timeouts above (tens of seconds) absorb.

- **Threads** (``use_scheduler_threads``): the event loop's default executor,
  where the scheduler's blocking calls run (``gateway.offloop``), gets
  ``CROWDTRAIN_SCHEDULER_THREADS`` threads instead of asyncio's
  ``min(32, cores + 4)``; the setting replaces daphne's ``ASGI_THREADS``.
- **Garbage collection**: the objects loaded at start (Django, the app) are
  frozen out of the collector, so its full passes scan only what the
  connections made. (Raising the young generation's threshold to 50,000
  stopped those passes while 5,000 agents joined, but it also kept the
  per-request database connections of Django's ASGI handler, garbage in
  cycles, open until a collection: a site polled four times a second ran
  PostgreSQL out of connections. That waits for a connection pool.)

- **Plain debug names** (``plain_debug_names``): autobahn builds the arguments
  of a debug log line for every frame it reads or sends, colouring names
  with click whether or not debug logging is on: 3.4% of a site process's
  interpreter time (py-spy, the scale bench's wide phase at 300 agents).
  Here those helpers give the names uncoloured, which costs next to nothing.
  Likewise each new connection pretty-printed its 40-odd settings for a debug
  line (``pprint.pformat``): 4.8% of a site process's interpreter time while
  1,000 agents joined. Here that text is made only if the line is written.

- **The Redis client's version, read once** (``redis_version_read_once``):
  redis-py reads its own package metadata (a file, parsed by the email
  parser) for every connection it opens, to name itself to the server. When
  1,000 agents left at once, each leaving removed it from a channel-layer
  group over a new connection, and that reading was 11.7% of a site
  process's interpreter time (py-spy, the scale bench's W1-like phase).

Options given on the command line come after ours, so they win.
"""

from __future__ import annotations

import functools
import gc
import importlib
import io
import logging
import math
import pprint
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

APPLICATION = "crowdtrain.asgi:application"
logger = logging.getLogger(__name__)
DAPHNE_PINGS_OFF_S = 10**9  # daphne's --ping-interval: no socket is that old, so daphne never pings
REAP_EVERY_S = 5
TIMEOUTS_EVERY_S = 4  # a multiple of daphne's 2 s


def site_websocket_protocol() -> type:
    """daphne's WebSocket protocol with the site's handshake checks and keepalive (see the module's docstring)."""
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
    """daphne's ``Server`` with the site's WebSocket protocol and its walks paced (module docstring).

    Built on call: importing daphne's server installs twisted's asyncio
    reactor, which only a process that is about to serve should do.
    """
    from daphne.server import Server
    from django.conf import settings
    from twisted.internet import reactor

    protocol = site_websocket_protocol()

    class SiteServer(Server):
        _reap_ticks = 0
        _timeout_ticks = 0
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

        # daphne's checkers reschedule themselves (1 s and 2 s on); the ticks we skip do the same.
        def application_checker(self) -> None:
            self._reap_ticks += 1
            if self._reap_ticks % REAP_EVERY_S:
                cast(Any, reactor).callLater(1, self.application_checker)
                return
            super().application_checker()

        def timeout_checker(self) -> None:
            self._timeout_ticks += 1
            if self._timeout_ticks % (TIMEOUTS_EVERY_S // 2):
                cast(Any, reactor).callLater(2, self.timeout_checker)
                return
            super().timeout_checker()

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


def _plain_type(obj: object) -> str:
    return f"<{getattr(obj, '__qualname__', type(obj).__qualname__)}>"


def _plain_value(value: object, color: str = "", bold: bool = True) -> str:
    return f"{value}"


class _PrettyWhenWritten:
    """``pprint.pformat(value)`` made when a log line is formatted, not when its arguments are gathered."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __str__(self) -> str:
        return pprint.pformat(self.value)


def plain_debug_names() -> None:
    """Have autobahn's WebSocket code build its debug lines' arguments cheaply (see above)."""
    from autobahn.twisted import websocket as twisted_websocket
    from autobahn.websocket import protocol

    for module in (twisted_websocket, protocol):
        for name, plain in (("hltype", _plain_type), ("hlval", _plain_value)):
            if hasattr(module, name):  # imported from autobahn.util by name: replaced where they are used
                setattr(module, name, plain)
    if getattr(protocol, "pformat", None) is pprint.pformat:  # imported by name too: used for a new connection
        protocol.pformat = _PrettyWhenWritten  # type: ignore[assignment]


def redis_version_read_once() -> None:
    """Have redis-py look up its own version once per process, not once per connection (see above)."""
    import redis.utils

    if not hasattr(redis.utils.get_lib_version, "cache_info"):
        # Looked up by name each time a connection is made (redis.driver_info), so replacing it here is enough.
        redis.utils.get_lib_version = functools.cache(redis.utils.get_lib_version)


def main(argv: Sequence[str] | None = None) -> Any:
    """Serve ``crowdtrain.asgi:application`` with daphne's command line (``argv`` without the application)."""
    from daphne.cli import CommandLineInterface

    importlib.import_module(APPLICATION.partition(":")[0])  # daphne finds it loaded
    refuse_failed_checks()
    use_scheduler_threads()
    plain_debug_names()
    redis_version_read_once()
    gc.freeze()
    cli = CommandLineInterface()
    cli.server_class = server_class()
    args = list(sys.argv[1:] if argv is None else argv)
    return cli.run([*keepalive_args(), *args, APPLICATION])


if __name__ == "__main__":
    main()
