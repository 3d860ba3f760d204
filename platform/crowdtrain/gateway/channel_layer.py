"""channels_redis's layer, whose Redis connections are waited for when all are in use, not refused.

redis-py's asyncio pool raises "Too many connections" once
``CHANNEL_LAYER_MAX_CONNECTIONS`` are out, and a crowd leaving at once (a
network outage, a restart of the load balancer) leaves its groups at the same
moment, cutting cleanup short. redis-py's ``BlockingConnectionPool`` makes such
a burst wait its turn instead, for up to ``WAIT_FOR_CONNECTION_S``.

A connection is held from a command's sending to its answer being read, and
an event loop that runs late reads late, so every round trip saved is a
connection free sooner: each send here is one round trip (``PUSH``, a
server-side script) where channels_redis makes four, and one event for many
sockets is one round trip per process inbox. The channels_redis internals this
relies on, and the figures that justify it, are listed in ``crowdtrain.lib.patches``.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from channels.exceptions import ChannelFull
from channels_redis.core import RedisChannelLayer
from redis.asyncio import BlockingConnectionPool

# A call waits this long for a free connection; past it redis-py raises ConnectionError, as before.
# Under daphne's 10 s application_close_timeout, after which a closed socket's cleanup is cancelled.
WAIT_FOR_CONNECTION_S = 8.0

# What channels_redis's send does in four round trips (drop expired events, count, add, renew the key's
# expiry), for any number of events to one inbox, in one. KEYS[1]: the inbox; ARGV: the time (the events'
# score), the oldest score kept, the key's expiry in seconds, the inbox's capacity, then the events.
# Returns how many events found no room.
PUSH = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], 0, ARGV[2])
local room = tonumber(ARGV[4]) - redis.call('ZCOUNT', KEYS[1], '-inf', '+inf')
local added = 0
for i = 5, #ARGV do
  if added >= room then break end
  redis.call('ZADD', KEYS[1], ARGV[1], ARGV[i])
  added = added + 1
end
if added > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return #ARGV - 4 - added
"""


# A key with no expiry that each process reads every housekeeping round: when it is gone, the Redis
# that holds the groups was emptied (FLUSHDB, a restart without persistence) and every group with it.
MARK_KEY = "groups-mark"


async def send_each(layer: Any, channels: Iterable[str], message: dict[str, Any]) -> int:
    """``send`` to each channel in turn, on any layer; returns how many were refused because an inbox was full."""
    refused = 0
    for channel in channels:
        try:
            await layer.send(channel, message)
        except ChannelFull:
            refused += 1
    return refused


class WaitingRedisChannelLayer(RedisChannelLayer):
    """``RedisChannelLayer`` on a ``BlockingConnectionPool`` for each host given as ``{"address": url, ...}``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._push_script: Any = None  # PUSH, registered once (by its digest); run on whichever client is asked
        self._seen: dict[int, tuple[Any, Any]] = {}  # host -> (run_id, mark) it had at the last check

    async def groups_forgotten(self) -> bool:
        """Whether a host may have lost groups since the last call: it restarted, or its data was dropped.

        Redis names each run of its server (``run_id``), and the mark key goes with
        a flush or a restart that loaded nothing. A restart that loaded an older
        snapshot keeps the mark but not the run: groups joined since are gone
        either way. The first call only takes note. One round trip per host.
        """
        forgotten = False
        for index in range(self.ring_size):
            async with self.connection(index).pipeline(transaction=False) as pipe:
                pipe.info("server")
                pipe.set(self.prefix + MARK_KEY, uuid.uuid4().hex, nx=True)
                pipe.get(self.prefix + MARK_KEY)
                server, _, mark = await pipe.execute()
            now = (server.get("run_id"), mark)
            seen = self._seen.get(index)
            self._seen[index] = now
            forgotten = forgotten or (seen is not None and seen != now)
        return forgotten

    def create_pool(self, index: int) -> Any:
        host = dict(self.hosts[index])
        if "address" not in host:  # a Sentinel or a host given piece by piece: channels_redis's own pool
            return super().create_pool(index)
        address = host.pop("address")
        return BlockingConnectionPool.from_url(address, timeout=WAIT_FOR_CONNECTION_S, **host)

    async def group_add_many(self, memberships: list[tuple[str, str]]) -> None:
        """``group_add`` for every (group, channel): one pipelined round trip per host, not two per membership.

        What ``crowdtrain.gateway.groups`` refreshes each round; the same sorted-set
        scores and key expiry as ``group_add``, so channels_redis reads them as its own.
        """
        now = time.time()
        by_host: dict[int, dict[bytes, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
        for group, channel in memberships:
            assert self.require_valid_group_name(group) and self.require_valid_channel_name(channel)
            by_host[self.consistent_hash(group)][self._group_key(group)][channel] = now
        for index, groups in by_host.items():
            async with self.connection(index).pipeline(transaction=False) as pipe:
                for key, members in groups.items():
                    pipe.zadd(key, members)
                    pipe.expire(key, self.group_expiry)
                await pipe.execute()

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        """channels_redis's ``send`` in one round trip; raises ``ChannelFull`` as it does."""
        assert isinstance(message, dict), "message is not a dict"
        assert self.require_valid_channel_name(channel), "Channel name not valid"
        assert "__asgi_channel__" not in message
        if "!" in channel:  # a socket's channel: its process's inbox, the full name inside the event
            index = self.consistent_hash(channel)
            body = self.serialize({**message, "__asgi_channel__": channel})
        else:  # a general channel: any host, as channels_redis picks
            index = next(self._send_index_generator)
            body = self.serialize(message)
        if await self._push(index, self.prefix + self.non_local_name(channel), self.get_capacity(channel), [body]):
            raise ChannelFull()

    async def send_many(self, channels: Iterable[str], message: dict[str, Any]) -> int:
        """``send`` of one event to many sockets; returns how many were refused because their inbox was full.

        A commit wakes as many waiting lease requests as it made room for, and
        a process's sockets share one inbox, so this is one round trip per inbox,
        which takes what it has room for and refuses the rest.
        """
        inboxes: dict[tuple[int, str], list[str]] = defaultdict(list)
        general: list[str] = []  # none of the site's sockets: sent on their own
        for channel in channels:
            if "!" not in channel:
                general.append(channel)
                continue
            assert self.require_valid_channel_name(channel), "Channel name not valid"
            inboxes[(self.consistent_hash(channel), self.prefix + self.non_local_name(channel))].append(channel)
        refused = await send_each(self, general, message)
        for (index, key), members in inboxes.items():
            bodies = [self.serialize({**message, "__asgi_channel__": channel}) for channel in members]
            refused += await self._push(index, key, self.get_capacity(members[0]), bodies)
        return refused

    async def _push(self, index: int, key: str, capacity: int, bodies: list[bytes]) -> int:
        """Add events to one inbox as far as its capacity allows; returns how many found no room."""
        now = time.time()
        connection = self.connection(index)  # one client per event loop: the script is run with this one
        if self._push_script is None:
            self._push_script = connection.register_script(PUSH)
        expiry = int(self.expiry)
        args = [now, int(now) - expiry, expiry, capacity, *bodies]
        refused = await self._push_script(keys=[key], args=args, client=connection)
        return int(refused)
