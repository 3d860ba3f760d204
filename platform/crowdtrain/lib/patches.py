"""Every place the site reaches into a library's internals, listed once, so that upgrading that library is a decision.

Each ``Patch`` says what it touches, why, the library version it was written
and measured for, the figure that justifies it and the bench line or test
that shows it. ``tests/test_patches.py`` fails when an installed version
differs from ``written_for`` or a touched internal is gone or changed shape:
re-measure, then update the entry or drop the patch.

Two kinds of entries: those with an ``apply`` function replace a library's
module attribute in place, and ``crowdtrain.lib.daphne_site.main`` runs them all
(``apply_all``) before serving; the others are subclasses kept beside the code
that uses them (``where``), listed here for the internals they depend on.
"""

from __future__ import annotations

import functools
import pprint
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

# daphne walks its connections every 1 s (reaping) and 2 s (timeouts, pings); PacedWalks stretches both.
REAP_EVERY_S = 5
TIMEOUTS_EVERY_S = 4  # a multiple of daphne's 2 s


@dataclass(frozen=True)
class Internal:
    """One private name a patch depends on.

    ``path`` is ``module:attribute`` or ``module:Class.attribute``; an
    attribute a class sets on its instances is found by ``self.<name> =`` in
    the class's source. ``signature`` is ``str(inspect.signature(...))`` of a
    callable when the patch calls or overrides it with those parameters
    (None: only its presence matters).
    """

    path: str
    signature: str | None = None


@dataclass(frozen=True)
class Patch:
    name: str
    library: str  # the distribution, as importlib.metadata names it
    written_for: str  # the installed version the patch was written and last measured for
    touches: tuple[Internal, ...]
    why: str
    gain: str  # the figure that keeps it (or, for a fix, the failure it prevents)
    shown_by: str  # the `bench:` line or the test to re-run after an upgrade
    apply: Callable[[], None] | None = None  # replaces module attributes; None: a subclass at `where`
    where: str = ""


# ------------------------------------------------------------------ applied in place


def _plain_type(obj: object) -> str:
    return f"<{getattr(obj, '__qualname__', type(obj).__qualname__)}>"


def _plain_value(value: object, color: str = "", bold: bool = True) -> str:  # noqa: ARG001 (autobahn's hlval)
    return f"{value}"


class _PrettyWhenWritten:
    """``pprint.pformat(value)`` made when a log line is formatted, not when its arguments are gathered."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __str__(self) -> str:
        return pprint.pformat(self.value)


def plain_debug_names() -> None:
    """Have autobahn build the arguments of its debug lines cheaply, whether or not debug logging is on."""
    from autobahn.twisted import websocket as twisted_websocket
    from autobahn.websocket import protocol

    for module in (twisted_websocket, protocol):
        for name, plain in (("hltype", _plain_type), ("hlval", _plain_value)):
            if hasattr(module, name):  # imported from autobahn.util by name: replaced where they are used
                setattr(module, name, plain)
    if getattr(protocol, "pformat", None) is pprint.pformat:  # imported by name too: used for a new connection
        protocol.pformat = _PrettyWhenWritten  # type: ignore[assignment]


def redis_version_read_once() -> None:
    """Have redis-py look up its own version once per process, not once per connection."""
    import redis.utils

    if not hasattr(redis.utils.get_lib_version, "cache_info"):
        # Looked up by name each time a connection is made (redis.driver_info), so replacing it here is enough.
        redis.utils.get_lib_version = functools.cache(redis.utils.get_lib_version)


# ------------------------------------------------------------------ subclassed where used


class PacedWalks:
    """Mixin for daphne's ``Server``: its walks over every connection run every few seconds, not every second.

    daphne's checkers reschedule themselves (1 s and 2 s on); the ticks skipped
    here do the same. A closed socket's record lingers a few seconds longer and
    a ping or handshake timeout is up to 2 s later, which the site's timeouts
    (tens of seconds) absorb.
    """

    _reap_ticks = 0
    _timeout_ticks = 0

    def application_checker(self) -> None:
        from twisted.internet import reactor  # daphne's, installed by the time it serves

        self._reap_ticks += 1
        if self._reap_ticks % REAP_EVERY_S:
            cast(Any, reactor).callLater(1, self.application_checker)
            return
        cast(Any, super()).application_checker()

    def timeout_checker(self) -> None:
        from twisted.internet import reactor

        self._timeout_ticks += 1
        if self._timeout_ticks % (TIMEOUTS_EVERY_S // 2):
            cast(Any, reactor).callLater(2, self.timeout_checker)
            return
        cast(Any, super()).timeout_checker()


# ------------------------------------------------------------------ the registry

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="autobahn-debug-names",
        library="autobahn",
        written_for="26.10.2",
        touches=(
            Internal("autobahn.websocket.protocol:hltype", "(obj)"),
            Internal("autobahn.websocket.protocol:hlval", "(val, color='white', bold=True)"),
            Internal("autobahn.websocket.protocol:pformat"),
            Internal("autobahn.twisted.websocket:hltype", "(obj)"),
        ),
        why=(
            "autobahn builds the arguments of a debug line for every frame it reads or sends, colouring "
            "names with click whether or not debug logging is on, and pretty-prints a new connection's "
            "40-odd settings for another debug line; no option turns either off"
        ),
        gain=(
            "names: 3.4% of a site process's interpreter time (py-spy, scale bench wide phase, 300 agents); "
            "13.3 us -> 1.0 us per frame (timeit, 2026-11-29). Settings dump: 4.8% of a site process while "
            "1,000 agents joined; 641 us per connection, now made only if the line is written"
        ),
        shown_by=(
            "bench: site_cpu_ms_per_lease_300 and idle_cpu_pct_per_1000 (tests.benchmarks.scale); "
            "tests/web/gateway/test_daphne_site_names_plainly.py"
        ),
        apply=plain_debug_names,
    ),
    Patch(
        name="redis-version-read-once",
        library="redis",
        written_for="8.1.0",
        touches=(Internal("redis.utils:get_lib_version", "()"),),
        why=(
            "redis-py reads its own package metadata (a file, parsed by the email parser) for every "
            "connection it opens, to name itself to the server; no option skips it"
        ),
        gain=(
            "11.7% of a site process's interpreter time when 1,000 agents left at once, each leaving a "
            "channel-layer group over a new connection (py-spy, scale bench W1-like phase); a new "
            "connection object 615 us -> 19 us when written, 2,026 us -> 47 us on 2026-11-29 (loaded machine)"
        ),
        shown_by=(
            "bench: site_cpu_ms_per_lease_w1like_1000 (tests.benchmarks.scale); "
            "tests/web/gateway/test_daphne_site_reads_the_redis_version_once.py"
        ),
        apply=redis_version_read_once,
    ),
    Patch(
        name="daphne-paced-walks",
        library="daphne",
        written_for="4.2.3",
        touches=(
            Internal("daphne.server:Server.application_checker", "(self)"),
            Internal("daphne.server:Server.timeout_checker", "(self)"),
            Internal("daphne.server:Server.connections"),
        ),
        why=(
            "daphne walks every connection each second to reap finished application instances and every "
            "2 s to check timeouts and ping; with thousands of idle volunteers on a process those walks "
            "cost more than their heartbeats, and daphne has no setting for either interval"
        ),
        gain=(
            "application_checker took 2.1 ms per walk over 5,000 open sockets (2026-11-29); it now runs "
            "every REAP_EVERY_S instead of every second, timeout_checker every TIMEOUTS_EVERY_S instead of 2 s"
        ),
        shown_by=(
            "bench: idle_cpu_pct_per_1000 (tests.benchmarks.scale); tests/web/gateway/test_daphne_site_paces_reaping.py"
        ),
        where="crowdtrain.lib.daphne_site.server_class (PacedWalks above)",
    ),
    Patch(
        name="daphne-site-protocol",
        library="daphne",
        written_for="4.2.3",
        touches=(
            Internal("daphne.server:Server.run", "(self)"),  # assigns self.ws_factory, self.http_factory
            Internal("daphne.server:Server.ws_factory"),
            Internal("daphne.server:Server.http_factory"),
            Internal("daphne.server:twisted_loop"),
            Internal("daphne.ws_protocol:WebSocketProtocol.onConnect", "(self, request)"),
            Internal("daphne.ws_protocol:WebSocketProtocol.onClose", "(self, wasClean, code, reason)"),
            Internal("daphne.ws_protocol:WebSocketProtocol.handle_reply", "(self, message)"),
            Internal("daphne.ws_protocol:WebSocketProtocol.serverSend", "(self, content, binary=False)"),
        ),
        why=(
            "daphne makes its factories inside run() and listens at once, so the site's WebSocket protocol "
            "and keepalive are handed over by intercepting those attributes; its protocol crashed with "
            "HTTP 500 on an odd Sec-WebSocket-Protocol, dropped a close's reason and let autobahn raise "
            "into a consumer that sent to a closing socket"
        ),
        gain=(
            "a fix, not a speed-up: odd handshakes get 400 with the reason (500 or a reset before), a close "
            "keeps its reason, a client that sends but never reads is dropped within the ping timeout"
        ),
        shown_by=(
            "tests/e2e/test_odd_handshakes_are_refused_plainly.py; "
            "tests/web/gateway/test_a_message_for_a_closing_socket_is_dropped.py"
        ),
        where="crowdtrain.lib.daphne_site.site_websocket_protocol and server_class",
    ),
    Patch(
        name="twisted-long-lines",
        library="twisted",
        written_for="26.10.0",
        touches=(
            Internal("twisted.web.http:HTTPChannel.lineLengthExceeded", "(self, line)"),
            Internal("twisted.web.http:_GenericHTTPChannelProtocol._channel"),
        ),
        why=(
            "twisted hangs up without a word on a header line over its 16 KiB limit; the site answers 431 "
            "by replacing the channel's lineLengthExceeded, reached through the HTTP/2 negotiating wrapper"
        ),
        gain="a fix, not a speed-up: a too-long header line gets HTTP 431 instead of a silent close",
        shown_by="tests/e2e/test_odd_handshakes_are_refused_plainly.py",
        where="crowdtrain.lib.daphne_site.answer_long_lines",
    ),
    Patch(
        name="channels-redis-waiting-layer",
        library="channels_redis",
        written_for="4.3.0",
        touches=(
            Internal("channels_redis.core:RedisChannelLayer.create_pool", "(self, index)"),
            Internal("channels_redis.core:RedisChannelLayer.connection", "(self, index)"),
            Internal("channels_redis.core:RedisChannelLayer.consistent_hash", "(self, value)"),
            Internal("channels_redis.core:RedisChannelLayer.serialize", "(self, message)"),
            Internal("channels_redis.core:RedisChannelLayer._group_key", "(self, group)"),
            # send's storage, which the PUSH script writes and receive reads: a sorted set scored by time.
            Internal("channels_redis.core:RedisChannelLayer._brpop_with_clean", "(self, index, channel, timeout)"),
            Internal("channels_redis.core:RedisChannelLayer._send_index_generator"),
            Internal("channels_redis.core:RedisChannelLayer.hosts"),
            Internal("channels_redis.core:RedisChannelLayer.ring_size"),
            Internal("channels_redis.core:RedisChannelLayer.prefix"),
            Internal("channels_redis.core:RedisChannelLayer.expiry"),
            Internal("channels_redis.core:RedisChannelLayer.group_expiry"),
        ),
        why=(
            "channels_redis refuses a call when its pool is out of connections and sends in four round "
            "trips; the subclass waits for a connection (BlockingConnectionPool), sends in one (a Lua "
            "script writing channels_redis's own sorted sets) and adds many memberships per round trip"
        ),
        gain=(
            "1,704 group leaves failed in one overload run before; 5,000 agents joining two site processes: "
            "225 connected before (connections held by four-trip sends); a commit's wakes were 9% of a site "
            "process on the W1-like step, 0.3% after"
        ),
        shown_by=(
            "bench: connect_p99_ms_5000, overload_lost, site_cpu_ms_per_lease_w1like_1000 "
            "(tests.benchmarks.scale); tests/web/gateway/test_redis_channel_layer_waits_out_idle_time.py"
        ),
        where="crowdtrain.gateway.channel_layer.WaitingRedisChannelLayer",
    ),
)


def apply_all() -> None:
    """Apply every in-place patch; a serving process calls this once, before it listens."""
    for patch in PATCHES:
        if patch.apply is not None:
            patch.apply()
