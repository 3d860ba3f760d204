"""Orders for aggregators (commits, assignments, rollbacks) on a Redis pub/sub channel, straight to their sockets.

A step's agents wait for its commit to reach the aggregators, and the channel
layer's way there crossed the site's busiest parts. Timed in the scale bench
(300 agents, two site processes on 2 cores): from a step's "committed" to the
aggregator's "applied" took 0.4 to 1.5 s, of which the aggregator used 0.05 to
0.1 s. The committing thread's result waited 0.1 to 0.28 s for its event loop;
channels_redis's ``group_send`` (three round trips, a loop cycle each) took
0.22 to 0.47 s; and the commit then queued 0.04 to 1.06 s in the process inbox
of the site process holding the aggregator's socket, behind every agent's wake
and timer.

So, with Redis, orders are published on one channel: by the committing thread
itself (``publish_now``, a synchronous client, before it hands its result back
to its loop), or from a loop (``send``). Each site process reads the channel
with one subscriber task and writes an order for an aggregator whose socket it
holds to that socket at once, ahead of the consumer's queue. Every process
hears every order: a few per step, whatever the number of volunteers. An order
no process heard (a subscriber reconnecting after Redis restarted) goes by the
channel layer's group as well, and the site re-sends stalled commits on every
aggregator heartbeat. Without Redis (the embedded default, one process) orders
use the in-process channel layer as before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import redis
from channels.layers import get_channel_layer
from django.conf import settings
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

RECONNECT_S = (0.1, 0.5, 2.0)  # a subscriber's waits between tries to subscribe again, then the last for good

Event = dict[str, Any]  # a channel-layer event, as ``outbox.send_event`` makes it
Forward = Callable[[Event], Awaitable[None]]


def enabled() -> bool:
    return bool(settings.REDIS_URL)


def channel() -> str:
    """The channel's name: pub/sub ignores Redis's database numbers, so the site's own database is in it."""
    db = redis.connection.parse_url(settings.REDIS_URL).get("db", 0)
    return f"{settings.CROWDTRAIN_REDIS_PREFIX}:{db}:backbone-orders"


def payload(aggregator_id: int, event: Event) -> str:
    return json.dumps({"aggregator": aggregator_id, "event": event})


_client_lock = threading.Lock()
_client: redis.Redis | None = None


def _sync_client() -> redis.Redis:
    global _client
    with _client_lock:
        if _client is None:
            _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5.0, health_check_interval=30)
        return _client


def publish_now(orders: Iterable[tuple[int, Event]]) -> bool:
    """Publish (aggregator id, event) orders from any thread; False when any of them needs sending again.

    A message no site process heard, or a Redis that could not be reached, is
    left to ``send``, which also tries the channel layer's group.
    """
    if not enabled():
        return False
    try:
        return all(_sync_client().publish(channel(), payload(a, m)) > 0 for a, m in orders)
    except RedisError as exc:
        logger.warning("could not publish aggregator orders (%s); sending them through the channel layer", exc)
        return False


async def send(aggregator_id: int, event: Event, group: str) -> None:
    """One order from an event loop: published on the lane, and through ``group`` where no process heard it."""
    layer = get_channel_layer()
    if enabled():
        text = payload(aggregator_id, event)
        try:
            if await layer.connection(0).publish(channel(), text) > 0:
                return
        except RedisError as exc:
            logger.warning("could not publish an order for aggregator %s (%s)", aggregator_id, exc)
    await layer.group_send(group, event)


class Subscriber:
    """This process's reader of the lane, and the aggregator sockets it holds.

    ``hold`` registers a socket (at its hello) and starts the reader on the
    running loop if it is not reading there yet; ``release`` forgets it.
    """

    def __init__(self) -> None:
        self._sockets: dict[int, Forward] = {}
        self._task: asyncio.Task[None] | None = None
        self.subscribed = asyncio.Event()  # set while subscribed (tests wait for it)

    def hold(self, aggregator_id: int, forward: Forward) -> None:
        self._sockets[aggregator_id] = forward
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self.subscribed = asyncio.Event()
            self._task = loop.create_task(self._read(), name="crowdtrain-backbone-lane")

    def release(self, aggregator_id: int, forward: Forward) -> None:
        if self._sockets.get(aggregator_id) == forward:
            del self._sockets[aggregator_id]

    async def _read(self) -> None:
        tries = 0
        while True:
            pubsub = get_channel_layer().connection(0).pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel())
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
                self.subscribed.clear()
                wait = RECONNECT_S[min(tries, len(RECONNECT_S) - 1)]
                tries += 1
                logger.warning("aggregator orders: lost the subscription (%s); subscribing again in %g s", exc, wait)
                await asyncio.sleep(wait)
            finally:
                try:
                    await pubsub.aclose()
                except (RedisError, OSError):
                    pass

    async def _deliver(self, data: bytes | str) -> None:
        try:
            order = json.loads(data)
            forward = self._sockets.get(int(order["aggregator"]))
        except (ValueError, KeyError, TypeError):
            logger.warning("aggregator orders: ignoring a message that is not an order: %r", data[:200])
            return
        if forward is None:
            return  # that aggregator's socket is held by another site process
        try:
            await forward(order["event"])
        except Exception:  # one closing socket must not end the lane for the others
            logger.exception("aggregator orders: could not forward an order to aggregator %s", order["aggregator"])


subscriber = Subscriber()
