"""Leaderboards on Redis sorted sets, fed by the ledger, so a page costs the same with 100 or 100,000 volunteers.

Each board is a sorted set of subject ids (volunteers or teams) scored by credit, for one scope (every campaign,
or one) and one period (all time, the last 7 days, the last 24 hours). A grant or a reversal adds its credit to
the all-time set, to its hour's bucket, and to the window sets its hour still lies in; a reversal counts in the
hour of the grant it takes back, so a window never shows work that was taken back. Hours that leave a window are
subtracted from it (``age_out``, run before every read and by Celery beat), so the windows move hour by hour.

The sets are a projection of the ledger, which stays the truth: when they are missing (a Redis restarted
empty, or the embedded default's in-process Redis after a restart) the first reader rebuilds them from the
ledger under a lock, and ``manage.py rebuild_leaderboards`` does it on demand (a nightly task too, which also
repairs an update that raced a rebuild).
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from django.db.models import Sum
from django.db.models.functions import TruncHour
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from crowdtrain.scheduler.hotstate import hot_state

from .models import FLOPS_PER_CREDIT, CreditEntry

logger = logging.getLogger(__name__)

Subject = Literal["volunteers", "teams"]
Period = Literal["24h", "7d", "all"]
SUBJECTS: tuple[Subject, ...] = ("volunteers", "teams")
PERIODS: dict[Period, str] = {"24h": "last 24 hours", "7d": "last 7 days", "all": "all time"}
WINDOW_HOURS = {"24h": 24, "7d": 24 * 7}
BUCKET_TTL_S = (24 * 7 + 2) * 3600  # an hour's bucket outlives the longest window it is subtracted from
EVERY_CAMPAIGN = 0  # the scope id of the global boards
REBUILD_LOCK_S = 120


@dataclass(frozen=True)
class Delta:
    """Credit that changed for one volunteer (and their team at the time) in one campaign, in a grant's hour."""

    volunteer_id: int
    team_id: int | None
    campaign_id: int
    credit: float
    hour: int  # hours since the epoch of the grant


def hour_of(moment: datetime) -> int:
    return int(moment.timestamp() // 3600)


def _prefix() -> str:
    return f"{hot_state().prefix}:lb:"


def _board(scope: int, subject: Subject, period: str) -> str:
    return f"{_prefix()}{scope}:{subject}:{period}"


def _bucket(scope: int, subject: Subject, hour: int) -> str:
    return f"{_prefix()}{scope}:{subject}:h:{hour}"


def _scopes_key() -> str:
    return f"{_prefix()}scopes"


def _aged_key() -> str:
    return f"{_prefix()}aged"  # the last hour subtracted from the windows


def _built_key() -> str:
    return f"{_prefix()}built"


def add(deltas: Iterable[Delta], now: float | None = None) -> None:
    """Apply grants and reversals to every board they count in, in one round trip."""
    deltas = list(deltas)
    if not deltas:
        return
    client = hot_state().client
    current = int((time.time() if now is None else now) // 3600)
    # A window holds the buckets after the hour it was last aged to, not after the clock's: ``age_out`` later
    # subtracts the bucket of each hour that leaves it, so a delta must be in the window exactly when its
    # bucket will be subtracted from it.
    client.set(_aged_key(), current, nx=True)
    aged = int(client.get(_aged_key()) or current)
    # Summed per board and member first: a step's commit brings a delta per lease, often many of one
    # volunteer, and each delta touches up to 16 sorted sets. One ZINCRBY per (board, member) keeps the
    # round trip (and the commit it follows, which the next step waits on) short.
    totals: dict[tuple[str, int], float] = defaultdict(float)
    scopes: set[int] = set()
    buckets: set[str] = set()
    for d in deltas:
        for scope in (EVERY_CAMPAIGN, d.campaign_id):
            scopes.add(scope)
            members: list[tuple[Subject, int]] = [("volunteers", d.volunteer_id)]
            if d.team_id is not None:
                members.append(("teams", d.team_id))
            for subject, member in members:
                totals[(_board(scope, subject, "all"), member)] += d.credit
                bucket = _bucket(scope, subject, d.hour)
                totals[(bucket, member)] += d.credit
                buckets.add(bucket)
                for period, hours in WINDOW_HOURS.items():
                    if d.hour > aged - hours:
                        totals[(_board(scope, subject, period), member)] += d.credit
    pipe = client.pipeline(transaction=False)
    pipe.sadd(_scopes_key(), *sorted(scopes))
    for (key, member), credit in totals.items():
        pipe.zincrby(key, credit, member)
    for bucket in sorted(buckets):
        pipe.expire(bucket, BUCKET_TTL_S)
    pipe.execute()


def age_out(now: float | None = None) -> None:
    """Subtract from each window the hours that have left it since the last call; cheap when none have."""
    client = hot_state().client
    current = int((time.time() if now is None else now) // 3600)
    aged = client.get(_aged_key())
    if aged is None:  # first call: nothing was added before this hour's windows existed
        client.set(_aged_key(), current, nx=True)
        return
    start = int(aged) + 1
    if start > current:
        return
    # One process at a time; another one that finds the lock taken reads boards an hour stale at worst.
    if not client.set(f"{_aged_key()}:lock", 1, nx=True, ex=60):
        return
    try:
        scopes = [int(s) for s in client.smembers(_scopes_key())]
        for hour in range(start, current + 1):
            pipe = client.pipeline(transaction=False)
            for scope in scopes:
                for subject in SUBJECTS:
                    for period, hours in WINDOW_HOURS.items():
                        left = hour - hours  # the hour that falls out of this window at ``hour``
                        window = _board(scope, subject, period)
                        pipe.zunionstore(window, {window: 1, _bucket(scope, subject, left): -1})
                        pipe.zremrangebyscore(window, "-inf", 1e-9)
            pipe.set(_aged_key(), hour)
            pipe.execute()
    finally:
        client.delete(f"{_aged_key()}:lock")


def ensure_built() -> None:
    """Rebuild the boards from the ledger if they are missing; others wait for the one process that does."""
    client = hot_state().client
    if client.exists(_built_key()):
        return
    lock = f"{_built_key()}:lock"
    if client.set(lock, 1, nx=True, ex=REBUILD_LOCK_S):
        try:
            rebuild()
        finally:
            client.delete(lock)
        return
    waiting = Retrying(
        retry=retry_if_result(lambda built: not built),
        wait=wait_fixed(0.05),
        stop=stop_after_delay(REBUILD_LOCK_S),
        retry_error_callback=lambda state: False,  # the builder's lock expired: read what there is
    )
    waiting(client.exists, _built_key())


def rebuild(now: float | None = None) -> None:
    """Recompute every board from the ledger: sums per subject for all time, and per hour for the last week."""
    started = time.monotonic()
    client = hot_state().client
    current = int((time.time() if now is None else now) // 3600)
    for key in client.scan_iter(f"{_prefix()}*"):
        if not key.endswith(":lock"):
            client.delete(key)
    totals = CreditEntry.objects.values("volunteer_id", "team_id", "campaign_id").annotate(flops=Sum("flops"))
    # All-time sums go straight in; hourly ones feed the buckets and windows.
    pipe = client.pipeline(transaction=False)
    for row in totals.iterator(chunk_size=10_000):
        credit = _credit(row["flops"])
        if abs(credit) < 1e-12:
            continue
        for scope in (EVERY_CAMPAIGN, row["campaign_id"]):
            pipe.sadd(_scopes_key(), scope)
            pipe.zincrby(_board(scope, "volunteers", "all"), credit, row["volunteer_id"])
            if row["team_id"] is not None:
                pipe.zincrby(_board(scope, "teams", "all"), credit, row["team_id"])
        if len(pipe) > 50_000:
            pipe.execute()
    pipe.execute()
    since = datetime.fromtimestamp((current - WINDOW_HOURS["7d"] + 1) * 3600, tz=UTC)
    hourly = (
        CreditEntry.objects.filter(created_at__gte=since)
        .annotate(hour=TruncHour("created_at"))
        .values("volunteer_id", "team_id", "campaign_id", "hour")
        .annotate(flops=Sum("flops"))
    )
    recent = [
        Delta(
            r["volunteer_id"],
            r["team_id"],
            r["campaign_id"],
            (r["flops"] or 0.0) / FLOPS_PER_CREDIT,
            hour_of(r["hour"]),
        )
        for r in hourly.iterator(chunk_size=10_000)
    ]
    _add_recent(recent, current)
    client.set(_aged_key(), current)
    client.set(_built_key(), int(time.time()))
    logger.info("leaderboards rebuilt from the ledger in %.2f s", time.monotonic() - started)


def _credit(flops: float | None) -> float:
    return (flops or 0.0) / FLOPS_PER_CREDIT


def _add_recent(deltas: list[Delta], current: int) -> None:
    """Like ``add`` without the all-time sets (already summed)."""
    client = hot_state().client
    pipe = client.pipeline(transaction=False)
    for d in deltas:
        if abs(d.credit) < 1e-12:
            continue
        for scope in (EVERY_CAMPAIGN, d.campaign_id):
            members: list[tuple[Subject, int]] = [("volunteers", d.volunteer_id)]
            if d.team_id is not None:
                members.append(("teams", d.team_id))
            for subject, member in members:
                bucket = _bucket(scope, subject, d.hour)
                pipe.zincrby(bucket, d.credit, member)
                pipe.expire(bucket, BUCKET_TTL_S)
                for period, hours in WINDOW_HOURS.items():
                    if d.hour > current - hours:
                        pipe.zincrby(_board(scope, subject, period), d.credit, member)
        if len(pipe) > 50_000:
            pipe.execute()
    pipe.execute()


@dataclass(frozen=True)
class Row:
    rank: int  # 1-based
    subject_id: int
    credit: float


def _ready() -> None:
    ensure_built()
    age_out()


def page(scope: int, subject: Subject, period: Period, offset: int, count: int) -> tuple[list[Row], int]:
    """Rows ``offset`` .. ``offset + count`` of a board, best first, and how many rows it has."""
    _ready()
    key = _board(scope, subject, period)
    pipe = hot_state().client.pipeline(transaction=False)
    pipe.zrevrange(key, offset, offset + count - 1, withscores=True)
    pipe.zcount(key, 1e-9, "+inf")
    found, total = pipe.execute()
    rows = [Row(offset + i + 1, int(member), float(score)) for i, (member, score) in enumerate(found) if score > 1e-9]
    return rows, int(total)


def size(scope: int, subject: Subject, period: Period) -> int:
    """How many rows a board has (subjects with credit), without reading any."""
    _ready()
    return int(hot_state().client.zcount(_board(scope, subject, period), 1e-9, "+inf"))


def standing(scope: int, subject: Subject, period: Period, subject_id: int) -> Row | None:
    """One subject's rank and credit on a board; None when it has no credit there."""
    _ready()
    key = _board(scope, subject, period)
    pipe = hot_state().client.pipeline(transaction=False)
    pipe.zrevrank(key, subject_id)
    pipe.zscore(key, subject_id)
    rank, score = pipe.execute()
    if rank is None or score is None or score <= 1e-9 or not math.isfinite(score):
        return None
    return Row(int(rank) + 1, subject_id, float(score))
