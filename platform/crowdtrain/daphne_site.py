"""Run the site's ASGI application on daphne, with housekeeping paced for thousands of quiet sockets.

    python -m crowdtrain.daphne_site -b 0.0.0.0 -p 8000 [more daphne options]

Every way the site is served (``manage.py serve``, the launcher's swarms and
``make cluster``, ``deploy/compose.yaml``) starts daphne through here, so they
share two choices:

- **Keepalive** (``KEEPALIVE_ARGS``): a WebSocket that has sent nothing for
  ``--ping-interval`` seconds is pinged, and one that has not answered within
  ``--ping-timeout`` is dropped. So what daphne buffers for a client that
  neither reads nor sends (a hung machine, a half-open TCP connection) is
  what the site sent it in those ~40 s at most, and its slot is freed. The
  interval is longer than the agents' heartbeat (``CROWDTRAIN_AGENT_HEARTBEAT_S``,
  25 s) and the aggregators' (2 s), so working peers are never pinged: at
  10,000 idle agents a ping and its pong for each were 7% of the site's CPU.
  A socket that never says hello is closed sooner, by the consumers
  (``CROWDTRAIN_HELLO_TIMEOUT_S``); a client that keeps sending but never
  reads is bounded by what it asks for, one reply per request.
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
import pprint
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

APPLICATION = "crowdtrain.asgi:application"
KEEPALIVE_ARGS = ("--ping-interval", "30", "--ping-timeout", "10")
REAP_EVERY_S = 5
TIMEOUTS_EVERY_S = 4  # a multiple of daphne's 2 s


def server_class() -> type:
    """daphne's ``Server`` with its walks over every connection paced by ``REAP_EVERY_S`` and ``TIMEOUTS_EVERY_S``.

    Built on call: importing daphne's server installs twisted's asyncio
    reactor, which only a process that is about to serve should do.
    """
    from daphne.server import Server
    from twisted.internet import reactor

    class SiteServer(Server):
        _reap_ticks = 0
        _timeout_ticks = 0

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
    return cli.run([*KEEPALIVE_ARGS, *args, APPLICATION])


if __name__ == "__main__":
    main()
