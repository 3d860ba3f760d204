"""channels_redis's layer, whose Redis connections are waited for when all are in use, not refused.

redis-py's asyncio pool raises "Too many connections" once
``CHANNEL_LAYER_MAX_CONNECTIONS`` are out. When thousands of volunteers
leave at once (the end of the scale bench's overload phase, a network
outage, a restart of the load balancer), every socket's ``disconnect``
leaves its groups at the same moment: 1,704 of them raised it in one run,
their cleanup cut short. redis-py's ``BlockingConnectionPool`` makes such a
burst wait its turn instead, for up to ``WAIT_FOR_CONNECTION_S``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from channels.exceptions import ChannelFull
from channels_redis.core import RedisChannelLayer
from redis.asyncio import BlockingConnectionPool

# A call waits this long for a free connection; past it redis-py raises ConnectionError, as before.
# Under daphne's 10 s application_close_timeout, after which a closed socket's cleanup is cancelled.
WAIT_FOR_CONNECTION_S = 8.0


class WaitingRedisChannelLayer(RedisChannelLayer):
    """``RedisChannelLayer`` on a ``BlockingConnectionPool`` for each host given as ``{"address": url, ...}``."""

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

    async def send_many(self, channels: Iterable[str], message: dict[str, Any]) -> int:
        """``send`` of one event to many sockets; returns how many were refused because their inbox was full.

        ``send`` makes four round trips per socket. A commit wakes as many waiting
        lease requests as it made room for, and on the W1-like step that loop was
        9% of a site process. A process's sockets share one inbox key, so this
        makes two pipelined round trips per key: trim and count, then add. An
        inbox takes what it has room for and no more; the rest are refused, as
        ``send`` refuses with ``ChannelFull``.
        """
        now = time.time()
        inboxes: dict[tuple[int, str], list[str]] = defaultdict(list)
        refused = 0
        for channel in channels:
            assert self.require_valid_channel_name(channel)
            if "!" not in channel:  # a general channel (none of the site's sockets): its own list
                try:
                    await self.send(channel, message)
                except ChannelFull:
                    refused += 1
                continue
            inboxes[(self.consistent_hash(channel), self.prefix + self.non_local_name(channel))].append(channel)
        for (index, key), members in inboxes.items():
            connection = self.connection(index)
            async with connection.pipeline(transaction=False) as pipe:
                pipe.zremrangebyscore(key, min=0, max=int(now) - int(self.expiry))
                pipe.zcount(key, "-inf", "+inf")
                _, held = await pipe.execute()
            room = max(0, self.get_capacity(members[0]) - int(held))
            refused += max(0, len(members) - room)
            if not room:
                continue
            bodies = {self.serialize({**message, "__asgi_channel__": channel}): now for channel in members[:room]}
            async with connection.pipeline(transaction=False) as pipe:
                pipe.zadd(key, bodies)
                pipe.expire(key, int(self.expiry))
                await pipe.execute()
        return refused
