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
(``crowdtrain.scheduler.rebuild.load_campaign``).
"""

from __future__ import annotations

import json
import logging
import secrets
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
# A device's activity record (crowdtrain.devices.activity) outlives a site process that died without
# removing it this long; its connection refreshes it at half this age. My devices reads a record only
# for a device the presence set says is online, so a leftover is never shown.
ACTIVITY_TTL_S = 3600.0
# A process's set of connected devices outlives its last batch this long (a process that died or stalled).
HERE_TTL_S = 300
SCRIPTS = ("lease", "done", "committed", "take", "release", "sweep", "park", "rollback", "load", "configure", "drop")


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
        self.commits_key = f"{prefix}:commits"  # full steps handed to the committers (scheduler.committer)
        self.committer_key = f"{prefix}:committer"  # running committers, scored by when each last said so
        self._scripts = {name: client.register_script(_script_text(name)) for name in SCRIPTS}
        self._standalone: dict[str, Any] = {}
        self.forget_if_ours = self.standalone("forget_if_ours")
        self.touch_here = self.standalone("touch_here")

    def standalone(self, name: str) -> Any:
        """A script of ``lua/`` that stands alone (no prelude, its own keys), registered once; call it with
        ``keys=`` and ``args=``."""
        script = self._standalone.get(name)
        if script is None:
            script = self._standalone[name] = self.client.register_script((LUA_DIR / f"{name}.lua").read_text())
        return script

    def campaign_key(self, hot_key: str) -> str:
        # The hash tag keeps one campaign's keys in one slot of a Redis Cluster.
        return f"{self.prefix}:{{{hot_key}}}:"

    def run(self, script: str, hot_key: str, args: dict[str, Any], *, now: float | None = None) -> dict[str, Any]:
        """Run one script for one campaign and return its decoded answer.

        Raises:
            HotStateMissing: if the campaign has no hot state yet.
        """
        raw = self._scripts[script](
            keys=[
                self.campaign_key(hot_key),
                self.seen_key,
                self.lease_campaigns_key,
                self.requests_key,
                self.commits_key,
                self.committer_key,
            ],
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

    def here_key(self, process: str) -> str:
        """The devices connected to one site process (``Presence``)."""
        return f"{self.seen_key}:here:{process}"

    def activity_key(self, device_id: int) -> str:
        # One hash tag for all of them: My devices reads a volunteer's devices with one MGET, in a Cluster too.
        return f"{self.prefix}:{{now}}:{device_id}"

    def mark_seen(self, device_ids: Iterable[int], *, at: float | None = None) -> None:
        """Record that these devices are connected now (their leases outlive their deadlines meanwhile)."""
        with self.client.pipeline(transaction=False) as pipe:
            self.queue_seen(pipe, device_ids, at=at)
            pipe.execute()

    def queue_seen(self, pipe: Any, device_ids: Iterable[int], *, at: float | None = None) -> None:
        stamp = self.clock() if at is None else at
        ids = list(device_ids)
        for start in range(0, len(ids), 1000):
            pipe.zadd(self.seen_key, {str(d): stamp for d in ids[start : start + 1000]})

    def activities(self, device_ids: Iterable[int]) -> dict[int, str]:
        """The activity records of these devices, as written (``crowdtrain.devices.activity``); one MGET."""
        ids = list(device_ids)
        if not ids:
            return {}
        values = self.client.mget([self.activity_key(d) for d in ids])
        return {d: str(v) for d, v in zip(ids, values, strict=True) if v is not None}

    def online_since(self, now: float | None = None) -> float:
        """The oldest presence stamp that still means "online now": every count, badge and metric of it uses this.

        A device ``CROWDTRAIN_GONE_AFTER_S`` past its last stamp has missed several heartbeats (a system check
        keeps the heartbeat well below it), so its socket is taken for gone.
        """
        return (self.clock() if now is None else now) - settings.CROWDTRAIN_GONE_AFTER_S

    def online_ids(self) -> list[int]:
        """The devices online now (``online_since``), in one read of the presence set."""
        members = cast(list[str], self.client.zrangebyscore(self.seen_key, self.online_since(), "+inf"))
        return [int(member) for member in members]  # decode_responses=True: members are str

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
        # This process's devices are also a set in Redis (``HotState.here_key``), which each batch stamps
        # as seen in Redis itself: a batch carries only who came and went since the last, so 5,000 idle
        # sockets cost a few commands every few seconds, not 5,000 members encoded and sent.
        self._here = secrets.token_hex(8)
        self._came: set[int] = set()
        self._went: set[int] = set()
        self._resend_here = True  # send the whole set (first batch, a failed one, a Redis that lost it)
        self._seen_since_db_write: set[int] = set()
        # Each connected device's newest activity record (My devices' "Now:"), and which changed since
        # the last batch; what the last batches wrote, and when; records to delete for devices that left.
        # A record may be kept unencoded (a callable that makes its text): an agent hears several answers
        # per batch and only the newest is written, so each is encoded once by the batch, not on every answer.
        self._activity: dict[int, str | Callable[[], str]] = {}
        self._changed: set[int] = set()
        self._written: dict[int, tuple[str, float]] = {}
        self._gone: dict[int, str] = {}

    def connected(self, device_id: int) -> None:
        with self._lock:
            self._connected[device_id] += 1
            self._seen_since_db_write.add(device_id)
            self._came.add(device_id)
            self._went.discard(device_id)
        hot_state().mark_seen([device_id])

    def disconnected(self, device_id: int) -> None:
        with self._lock:
            self._connected[device_id] -= 1
            if self._connected[device_id] <= 0:
                del self._connected[device_id]
                self._went.add(device_id)
                self._came.discard(device_id)
                # Its record goes with it (at the next batch), so the page never shows a gone device busy.
                self._activity.pop(device_id, None)
                self._changed.discard(device_id)
                written = self._written.pop(device_id, None)
                if written is not None:
                    self._gone[device_id] = written[0]

    def note(self, device_id: int, record: str | Callable[[], str]) -> None:
        """Keep a connected device's newest activity record for the next batch: a dict write, no I/O.

        Called for every answer a connection sends its agent, so it must stay
        O(1): the site serves thousands of agents, and only the batch talks to Redis.
        Encoding every record showed in a busy site process's profile (docs/performance.md,
        "Presence"), so a record may come as a callable, encoded only if it is still the newest.
        """
        with self._lock:
            if device_id in self._connected:  # a late answer to a socket that closed is nobody's news
                self._activity[device_id] = record
                self._changed.add(device_id)

    def newest(self, device_id: int) -> str | None:
        """The record the next batch writes for this device, if one waits."""
        with self._lock:
            record = self._activity.get(device_id)
        return None if record is None else _text(record)

    def device_ids(self) -> list[int]:
        with self._lock:
            return list(self._connected)

    def publish(self) -> int:
        """Mark every connected device as seen now, write the activity records that changed, delete those of
        devices that left, and forget devices not seen for a day: one pipelined round trip. Returns how many
        devices are connected.
        """
        state = hot_state()
        now = state.clock()
        with self._lock:
            count = len(self._connected)
            whole = self._resend_here
            came, went = (set(self._connected), set()) if whole else (self._came, self._went)
            self._came, self._went, self._resend_here = set(), set(), False
            kept = {d: self._activity[d] for d in self._changed if d in self._activity}
            self._changed = set()
            gone, self._gone = self._gone, {}
            # Unchanged records are only kept alive (EXPIRE, not SET): another process may hold the
            # device's newer connection, and its record must not be overwritten with ours.
            stale = [d for d, (_, at) in self._written.items() if at < now - ACTIVITY_TTL_S / 2 and d not in kept]
        changed = {d: _text(record) for d, record in kept.items()}
        try:
            with state.client.pipeline(transaction=False) as pipe:
                stamped = self._queue_here(state, pipe, now, came, went, whole=whole)
                pipe.zremrangebyscore(state.seen_key, "-inf", now - FORGET_SEEN_AFTER_S)
                for device_id, record in gone.items():
                    state.forget_if_ours(keys=[state.activity_key(device_id)], args=[record], client=pipe)
                for device_id, record in changed.items():
                    pipe.set(state.activity_key(device_id), record, ex=int(ACTIVITY_TTL_S))
                for device_id in stale:
                    pipe.expire(state.activity_key(device_id), int(ACTIVITY_TTL_S))
                answers = pipe.execute()
            if answers[stamped] != count:  # Redis lost the set (restarted empty, expired): send it whole now
                with self._lock:
                    everyone, self._came, self._went = set(self._connected), set(), set()
                with state.client.pipeline(transaction=False) as pipe:
                    self._queue_here(state, pipe, now, everyone, set(), whole=True)
                    pipe.execute()
        except Exception:
            with self._lock:  # the next batch tries again, unless newer news replaced them meanwhile
                self._changed |= {d for d in changed if d in self._activity}
                self._gone = {**gone, **self._gone}
                self._resend_here = True  # who came and went in this batch is not known to have arrived
            raise
        with self._lock:
            for device_id, record in changed.items():
                if device_id in self._connected:
                    self._written[device_id] = (record, now)
                else:  # it left while the batch was on its way: delete what the batch wrote
                    self._gone[device_id] = record
            for device_id in stale:
                if device_id in self._written:
                    self._written[device_id] = (self._written[device_id][0], now)
        return count

    def _queue_here(
        self, state: HotState, pipe: Any, now: float, came: set[int], went: set[int], *, whole: bool
    ) -> int:
        """Queue this process's set's changes (``whole``: ``came`` is all of it) and its stamp.

        Returns the index of the stamp's answer, the set's size as Redis has it.
        """
        key = state.here_key(self._here)
        if whole:
            pipe.delete(key)
        members = sorted(came)
        for start in range(0, len(members), 1000):
            pipe.sadd(key, *members[start : start + 1000])
        if went:
            pipe.srem(key, *sorted(went))
        stamped = len(pipe)
        state.touch_here(keys=[state.seen_key, key], args=[now, HERE_TTL_S], client=pipe)
        return stamped

    def take_db_batch(self) -> list[int]:
        """Devices to stamp ``last_seen_at`` on: every one seen since the last batch."""
        with self._lock:
            batch = self._seen_since_db_write | set(self._connected)
            self._seen_since_db_write = set()
            return sorted(batch)


def _text(record: str | Callable[[], str]) -> str:
    return record if isinstance(record, str) else record()


presence = Presence()
