"""The scheduler's hot state: per-campaign queues and counters in Redis, changed only by server-side scripts.

Every decision on the lease and done paths (which samples, which step, whether a
report counts, when a step is full) is one Lua script run atomically by Redis, so
any number of site processes serve one campaign without a lock of their own and
the cost of a call does not grow with the number of volunteers or leases in
flight. The scripts in ``lua/`` are the only definition of that logic: the
embedded default (no ``REDIS_URL``) runs the very same scripts in-process on
fakeredis, whose Lua runtime (lupa) needs no server.

Redis holds no durable truth: the database keeps every lease, step and credit
(``crowdtrain.scheduler.records``), and a campaign whose keys are missing (a
fresh Redis, a restart of the embedded site) is rebuilt from it
(``crowdtrain.scheduler.leasing.load_campaign``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from typing import Any, cast

import redis
from django.conf import settings

logger = logging.getLogger(__name__)

LUA_DIR = Path(__file__).with_name("lua")
# The presence set keeps devices this long after they were last seen ("online now" needs seconds).
FORGET_SEEN_AFTER_S = 86400.0
SCRIPTS = ("lease", "done", "committed", "release", "sweep", "park", "rollback", "load", "configure", "drop")


class HotStateMissing(RuntimeError):
    """A campaign's hot state is not in Redis (first use, or Redis restarted empty): rebuild it, then retry."""


@cache
def _script_text(name: str) -> str:
    return (LUA_DIR / "prelude.lua").read_text() + "\n" + (LUA_DIR / f"{name}.lua").read_text()


class HotState:
    """A Redis connection with the scheduler's scripts registered on it.

    Args:
        client: a ``redis.Redis`` (or fakeredis) client with ``decode_responses=True``.
        prefix: namespace of every key, so several sites can share one Redis.
    """

    def __init__(self, client: redis.Redis, prefix: str = "ct") -> None:
        self.client = client
        # Every script reads the time from here, never from Redis: tests move it forward.
        self.clock: Callable[[], float] = time.time
        self.prefix = prefix
        self.seen_key = f"{prefix}:seen"
        self.lease_campaigns_key = f"{prefix}:lc"
        self.requests_key = f"{prefix}:rid"  # device -> "campaign:lease:request id" of its last lease
        self._scripts = {name: client.register_script(_script_text(name)) for name in SCRIPTS}

    def campaign_key(self, hot_key: str) -> str:
        # The hash tag keeps one campaign's keys in one slot of a Redis Cluster.
        return f"{self.prefix}:{{{hot_key}}}:"

    def run(self, script: str, hot_key: str, args: dict[str, Any], *, now: float | None = None) -> dict[str, Any]:
        """Run one script for one campaign and return its decoded answer.

        Raises:
            HotStateMissing: if the campaign has no hot state yet.
        """
        raw = self._scripts[script](
            keys=[self.campaign_key(hot_key), self.seen_key, self.lease_campaigns_key, self.requests_key],
            args=[repr(self.clock() if now is None else now), json.dumps(args, separators=(",", ":"))],
        )
        answer = json.loads(raw)
        if isinstance(answer, dict) and answer.get("missing"):
            raise HotStateMissing(hot_key)
        return answer if isinstance(answer, dict) else {}

    def snapshot(self, hot_key: str) -> dict[str, Any]:
        """A campaign's hot state as plain data: for admins, tests and debugging, not the hot path."""
        key = self.campaign_key(hot_key)
        leases = [json.loads(raw) for raw in self.client.hvals(f"{key}leases")]
        redo = []
        for item in cast(list[str], self.client.lrange(f"{key}ret", 0, -1)):  # decode_responses=True
            epoch, start, count = (int(x) for x in item.split(":"))
            redo.append([epoch, start, count])
        return {
            "meta": self.client.hgetall(f"{key}meta"),
            "redo": redo,
            "leases": sorted(leases, key=lambda lease: lease["id"]),
            "waiting": self.client.zcard(f"{key}wait"),
        }

    def mark_seen(self, device_ids: Iterable[int], *, at: float | None = None) -> None:
        """Record that these devices are connected now (their leases outlive their deadlines meanwhile)."""
        stamp = self.clock() if at is None else at
        ids = list(device_ids)
        with self.client.pipeline(transaction=False) as pipe:
            for start in range(0, len(ids), 1000):
                pipe.zadd(self.seen_key, {str(d): stamp for d in ids[start : start + 1000]})
            pipe.execute()

    def last_seen(self, device_ids: Iterable[int]) -> dict[int, float]:
        ids = list(device_ids)
        if not ids:
            return {}
        scores = self.client.zmscore(self.seen_key, [str(d) for d in ids])
        return {d: float(s) for d, s in zip(ids, scores, strict=True) if s is not None}


_lock = threading.Lock()
_instance: HotState | None = None


def hot_state() -> HotState:
    """The process's connection: Redis at CROWDTRAIN_SCHEDULER_REDIS_URL (REDIS_URL by default), else in-process."""
    global _instance
    with _lock:
        if _instance is None:
            url = settings.CROWDTRAIN_SCHEDULER_REDIS_URL
            if url:
                client = redis.Redis.from_url(url, decode_responses=True, health_check_interval=30)
            else:
                import fakeredis  # the embedded default: the same scripts, run in this process

                client = fakeredis.FakeRedis(decode_responses=True)
            _instance = HotState(client, settings.CROWDTRAIN_REDIS_PREFIX)
        return _instance


def reset_hot_state() -> None:
    """Drop the process's connection (tests, and settings changes)."""
    global _instance
    with _lock:
        _instance = None


class Presence:
    """Which devices hold a socket to this process, published to Redis every few seconds.

    A heartbeat costs a set lookup, not a database write: liveness is the socket
    being open (daphne's pings close dead ones), written to the shared presence
    set in one batch for all connections of the process. A process that is behind
    on its messages still publishes on time, so its own backlog never makes its
    volunteers look gone. The database's ``last_seen_at`` is written lazily, in
    one statement per minute.
    """

    def __init__(self) -> None:
        self._connected: Counter[int] = Counter()
        self._lock = threading.Lock()
        self._seen_since_db_write: set[int] = set()

    def connected(self, device_id: int) -> None:
        with self._lock:
            self._connected[device_id] += 1
            self._seen_since_db_write.add(device_id)
        hot_state().mark_seen([device_id])

    def disconnected(self, device_id: int) -> None:
        with self._lock:
            self._connected[device_id] -= 1
            if self._connected[device_id] <= 0:
                del self._connected[device_id]

    def device_ids(self) -> list[int]:
        with self._lock:
            return list(self._connected)

    def publish(self) -> int:
        """Mark every connected device as seen now, and forget devices not seen for a day; returns how many."""
        ids = self.device_ids()
        state = hot_state()
        if ids:
            state.mark_seen(ids)
        state.client.zremrangebyscore(state.seen_key, "-inf", state.clock() - FORGET_SEEN_AFTER_S)
        return len(ids)

    def take_db_batch(self) -> list[int]:
        """Devices to stamp ``last_seen_at`` on: every one seen since the last batch."""
        with self._lock:
            batch = self._seen_since_db_write | set(self._connected)
            self._seen_since_db_write = set()
            return sorted(batch)


presence = Presence()
