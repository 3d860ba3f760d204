"""Who is in the swarm now: agents online, by accelerator, the most recently seen, and who joined or left.

Every figure comes from the scheduler's presence set in Redis (``ct:seen``,
stamped by each site process's housekeeping) plus aggregate queries on the
devices it names, so its cost is a few Redis calls and one query per 5,000
agents online, never a query per agent.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from django.db.models import Count, Sum
from django.db.models.fields.json import KT

from crowdtrain.accounts.models import Device
from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain.scheduler.models import Lease

KIND_BATCH = 5000  # presence ids looked up per query (as housekeeping and /metrics batch them)
TOP_AGENTS = 50
THROUGHPUT_WINDOW = timedelta(minutes=10)


@dataclass(frozen=True)
class Online:
    count: int
    by_kind: dict[str, int]


def online() -> Online:
    """Agents whose socket a site process reported within ``CROWDTRAIN_GONE_AFTER_S``, and their accelerators."""
    ids = hot_state().online_ids()
    by_kind: dict[str, int] = {}
    for start in range(0, len(ids), KIND_BATCH):
        rows = (
            Device.objects.filter(pk__in=ids[start : start + KIND_BATCH])
            .values(kind=KT("hardware__kind"))
            .annotate(n=Count("id"))
        )
        for row in rows:
            kind = str(row["kind"] or "unknown")
            by_kind[kind] = by_kind.get(kind, 0) + row["n"]
    return Online(len(ids), dict(sorted(by_kind.items())))


def most_recently_seen(limit: int = TOP_AGENTS) -> list[dict[str, Any]]:
    """The ``limit`` agents seen last, with their owner, accelerator, last-seen time and recent throughput.

    Throughput is samples per second of compute over the agent's accepted
    leases of the last ten minutes (what its own lease reports measured).
    """
    state = hot_state()
    seen = cast(list[tuple[str, float]], state.client.zrevrange(state.seen_key, 0, limit - 1, withscores=True))
    if not seen:
        return []
    ids = [int(member) for member, _ in seen]
    devices: dict[int, dict[str, Any]] = {
        row["id"]: dict(row)
        for row in Device.objects.filter(pk__in=ids).values("id", "name", "owner__username", kind=KT("hardware__kind"))
    }
    since = datetime.fromtimestamp(state.clock(), UTC) - THROUGHPUT_WINDOW
    rates: dict[int, dict[str, Any]] = {
        row["device_id"]: dict(row)
        for row in Lease.objects.filter(device_id__in=ids, state=Lease.State.ACCEPTED, finished_at__gte=since)
        .values("device_id")
        .annotate(samples=Sum("num_samples"), compute_s=Sum("compute_s"))
    }
    now = state.clock()
    fresh = state.online_since(now)
    agents = []
    for member, stamp in seen:
        device = devices.get(int(member))
        if device is None:
            continue  # deleted since it was seen
        rate = rates.get(device["id"])
        compute_s = (rate or {}).get("compute_s") or 0.0
        agents.append(
            {
                "id": device["id"],
                "name": device["name"],
                "volunteer": device["owner__username"],
                "kind": str(device["kind"] or "unknown"),
                "online": stamp >= fresh,
                "last_seen": stamp,
                "last_seen_s": max(0.0, now - stamp),
                "samples_per_s": (rate["samples"] / compute_s) if rate and compute_s > 0 else None,
            }
        )
    return agents


def joins_and_departures() -> tuple[int, int]:
    """Agents that came online and went offline since the last call (any process's), counted inside Redis.

    The online set is copied server-side (ZRANGESTORE) and compared with the
    previous call's copy (ZDIFFSTORE): no id crosses the network.
    """
    state = hot_state()
    now_key, prev_key, scratch = (f"{state.prefix}:dash:{name}" for name in ("online", "online:prev", "diff"))
    fresh = state.online_since()
    client = state.client
    client.zrangestore(now_key, state.seen_key, fresh, "+inf", byscore=True)
    # A missing key is an empty set to ZDIFFSTORE (Redis deletes empty sets): the first call counts
    # everyone online as joined.
    joins = int(client.zdiffstore(scratch, [now_key, prev_key]))
    departures = int(client.zdiffstore(scratch, [prev_key, now_key]))
    client.delete(scratch)
    if client.exists(now_key):
        client.rename(now_key, prev_key)
    else:
        client.delete(prev_key)
    return joins, departures
