"""Orders for aggregators (commits, assignments, rollbacks) by Redis pub/sub, straight to their sockets.

A step's agents wait for its commit to reach the aggregators, and the channel
layer's way there crossed the site's busiest parts: the committing thread's
result waited for its event loop, channels_redis's ``group_send`` took three
round trips of a loop cycle each, and the commit then queued in the process
inbox of the site process holding the aggregator's socket, behind every
agent's wake and timer (the timings are in docs/performance.md, "Aggregator
orders").

So, with channels_redis, each site process subscribes to a pub/sub channel of
its own and records in a Redis hash which aggregators' sockets it holds. An
order is published, in one script, on the channel of the process that holds
its aggregator: by the committing thread itself (``publish_now``, a
synchronous client, before it hands its result back to its loop) or from a
loop (``send``). That process's subscriber task writes it to the socket at
once, ahead of the consumer's queue. The script's count says whether that
process heard it; an order it did not hear (no holder recorded, a holder gone
or still subscribing, Redis away) goes by the channel layer's group as
before, and the site re-sends stalled commits on every aggregator heartbeat.
Without Redis (the embedded default, one process) orders use the in-process
channel layer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import redis
from channels.layers import get_channel_layer
from channels_redis.core import RedisChannelLayer
from django.conf import settings
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

logger = logging.getLogger(__name__)

RECONNECT_S = (0.1, 0.5, 2.0)  # a subscriber's waits between tries to subscribe again, then the last for good

Event = Any  # a channel-layer event, as ``outbox.send_event`` makes it
Forward = Callable[[Any], Awaitable[None]]

# KEYS[1]: the hash of aggregator id -> the channel of the process holding its socket.
# ARGV: aggregator id, the order. Returns how many subscribers heard it (0: no holder, or it is not listening).
_PUBLISH = """
local holder = redis.call('HGET', KEYS[1], ARGV[1])
if not holder then return 0 end
return redis.call('PUBLISH', holder, ARGV[2])
"""
# ARGV: aggregator id, the releasing process's channel: forgets the holder only if it is still that process.
_RELEASE = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


def enabled() -> bool:
    """Only on channels_redis: the lane needs its connections, and its process inboxes are what it skips."""
    return isinstance(get_channel_layer(), RedisChannelLayer)


def _namespace() -> str:
    # Pub/sub ignores Redis's database numbers, so the site's own database is in every name.
    db = redis.connection.parse_url(settings.REDIS_URL).get("db", 0)
    return f"{settings.CROWDTRAIN_REDIS_PREFIX}:{db}:backbone-lane"


def holders_key() -> str:
    return f"{_namespace()}:holders"


def payload(aggregator_id: int, event: Event) -> str:
    return json.dumps({"aggregator": aggregator_id, "event": event})


_client_lock = threading.Lock()
_client: redis.Redis | None = None


def _sync_client() -> redis.Redis:
    global _client
    with _client_lock:
        if _client is None:
            # One try, a short wait: a step's thread must not spend a minute on a Redis that is away; the
            # order then goes by the channel layer from the loop.
            _client = redis.Redis.from_url(
                settings.REDIS_URL,
                socket_timeout=2.0,
                socket_connect_timeout=1.0,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=30,
            )
        return _client


def publish_now(orders: Iterable[tuple[int, Event]]) -> bool:
    """Publish (aggregator id, event) orders from any thread; True when each one's holder heard it.

    Every order is tried; the caller sends all of them again from its loop when
    one was not heard (an aggregator acknowledges a commit it applied already).
    """
    if not enabled():
        return False
    heard = True
    try:
        client = _sync_client()
        for aggregator_id, event in orders:
            heard = (
                bool(client.eval(_PUBLISH, 1, holders_key(), aggregator_id, payload(aggregator_id, event))) and heard
            )
    except RedisError as exc:
        logger.warning("could not publish aggregator orders (%s); sending them through the channel layer", exc)
        return False
    return heard


async def send(aggregator_id: int, event: Event, group: str) -> None:
    """One order from an event loop: to its holder's subscriber, else through ``group`` (the channel layer)."""
    layer = get_channel_layer()
    if enabled():
        text = payload(aggregator_id, event)
        try:
            if await layer.connection(0).eval(_PUBLISH, 1, holders_key(), aggregator_id, text):
                return
        except RedisError as exc:
            logger.warning("could not publish an order for aggregator %s (%s)", aggregator_id, exc)
    await layer.group_send(group, event)


class Subscriber:
    """This process's reader of its own channel, and the aggregator sockets it holds.

    ``hold`` registers a socket (at its hello; again at each of its heartbeats,
    as a Redis restarted empty forgot it) and starts the reader on the running
    loop if it is not reading there yet; ``release`` forgets it.
    """

    def __init__(self) -> None:
        self.channel = uuid.uuid4().hex  # this process's; the full name adds the namespace (settings are read late)
        self._sockets: dict[int, Forward] = {}
        self._task: asyncio.Task[None] | None = None
        self.subscribed: asyncio.Event | None = None  # set while subscribed (tests wait for it)

    def _name(self) -> str:
        return f"{_namespace()}:process:{self.channel}"

    async def hold(self, aggregator_id: int, forward: Forward) -> None:
        if not enabled():
            return
        self._sockets[aggregator_id] = forward
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self.subscribed = asyncio.Event()
            self._task = loop.create_task(self._read(), name="crowdtrain-backbone-lane")
        try:
            await get_channel_layer().connection(0).hset(holders_key(), str(aggregator_id), self._name())
        except RedisError as exc:  # its orders go by the channel layer until the next heartbeat records it
            logger.warning("could not record aggregator %s's socket for its orders (%s)", aggregator_id, exc)

    async def release(self, aggregator_id: int, forward: Forward) -> None:
        if self._sockets.get(aggregator_id) != forward:
            return  # a newer socket of that aggregator took over here, or it never was held
        del self._sockets[aggregator_id]
        try:
            await get_channel_layer().connection(0).eval(_RELEASE, 1, holders_key(), aggregator_id, self._name())
        except RedisError as exc:  # a stale holder only makes its orders take the channel layer
            logger.warning("could not forget aggregator %s's socket (%s)", aggregator_id, exc)

    async def _read(self) -> None:
        tries = 0
        while True:
            pubsub = get_channel_layer().connection(0).pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._name())
                assert self.subscribed is not None
                self.subscribed.set()
                if tries:
                    logger.info("aggregator orders: subscribed again after %s tries", tries)
                tries = 0
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        await self._deliver(message["data"])
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                wait = RECONNECT_S[min(tries, len(RECONNECT_S) - 1)]
                tries += 1
                logger.warning("aggregator orders: lost the subscription (%s); subscribing again in %g s", exc, wait)
                await asyncio.sleep(wait)
            finally:
                if self.subscribed is not None:
                    self.subscribed.clear()
                try:
                    await pubsub.aclose()
                except (RedisError, OSError):
                    pass

    async def _deliver(self, data: bytes | str) -> None:
        try:
            order = json.loads(data)
            forward = self._sockets.get(int(order["aggregator"]))
            event = order["event"]
        except (ValueError, KeyError, TypeError):
            logger.warning("aggregator orders: ignoring a message that is not an order: %r", data[:200])
            return
        if forward is None:
            return  # its socket closed since it was published; the site sends stalled commits again
        try:
            await forward(event)
        except Exception:  # one closing socket must not end the lane for the others
            logger.exception("aggregator orders: could not forward an order to aggregator %s", order["aggregator"])


subscriber = Subscriber()
