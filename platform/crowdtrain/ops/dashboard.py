"""The admin dashboard's snapshot: the swarm, aggregators, campaigns, lease outcomes, queue, errors and alerts.

One JSON-able dict, pushed over ``/ws/dashboard/`` every
``CROWDTRAIN_DASHBOARD_PUSH_S`` while someone watches. Its cost does not grow
with volunteers: presence comes from Redis, agents by accelerator is one
aggregate query, the agent table is the 50 most recently seen, campaign
figures are per running campaign through indexes, and the history is the
cached, downsampled minute rows (``ops.history``). A snapshot is shared by
every watcher of a process for ``SHARE_S``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import redis
from django.conf import settings
from django.utils import timezone

from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain.scheduler.models import Aggregator, SliceAssignment

from . import health, heartbeats, history, recent_errors, swarm, task_failures
from .aggregator_probe import probe
from .models import SITE, DashboardSample

logger = logging.getLogger(__name__)

SHARE_S = 1.0
REASONS_WINDOW = timedelta(hours=1)


def celery_queue_depth() -> dict[str, Any]:
    """Messages waiting in the broker's default queue: LLEN when the broker is Redis."""
    broker = settings.CELERY_BROKER_URL
    if settings.CELERY_TASK_ALWAYS_EAGER or not broker.startswith(("redis://", "rediss://", "unix://")):
        return {"depth": None, "note": "not measured with the in-memory broker (tasks run in the site process)"}
    queue = getattr(settings, "CELERY_TASK_DEFAULT_QUEUE", "celery")
    try:
        client = redis.Redis.from_url(broker, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            depth = client.llen(queue)  # the synchronous client: an int
            return {"depth": int(depth), "queue": queue, "note": ""}
        finally:
            client.close()
    except redis.RedisError as exc:
        return {"depth": None, "queue": queue, "note": f"the broker did not answer ({type(exc).__name__})"}


def _aggregators() -> list[dict[str, Any]]:
    rows = list(Aggregator.objects.values("id", "name", "connected", "params_url", "last_seen_at").order_by("name"))
    held: dict[int, list[str]] = {}
    for slice_row in SliceAssignment.objects.values("aggregator_id", "campaign_id", "index", "ready", "version"):
        held.setdefault(slice_row["aggregator_id"], []).append(
            f"campaign {slice_row['campaign_id']} slice {slice_row['index']}"
            f" v{slice_row['version']}{'' if slice_row['ready'] else ' (not ready)'}"
        )
    heard = heartbeats.heard_at()
    now = hot_state().clock()
    readings = probe.read_all([(r["id"], r["params_url"]) for r in rows if r["connected"]])
    out = []
    for row in rows:
        reading = readings.get(row["id"], {})
        age = now - heard[row["id"]] if row["id"] in heard else None
        silent = not row["connected"] or (age is not None and age > settings.CROWDTRAIN_GONE_AFTER_S)
        versions_held = reading.get("versions_held") or {}
        out.append(
            {
                "id": row["id"],
                "name": row["name"],
                "host": urlsplit(row["params_url"]).netloc,
                "connected": row["connected"],
                "healthy": not silent,
                "heartbeat_age_s": age,
                "slices": held.get(row["id"], []),
                "memory_bytes": reading.get("memory_bytes"),
                "pending_bytes": reading.get("pending_bytes"),
                "pending_bytes_limit": reading.get("pending_bytes_limit"),
                "ingest_mb_s": reading.get("ingest_mb_s"),
                "versions_held": sum(versions_held.values()) if versions_held else None,
                "probe_error": reading.get("error", "") if row["connected"] else "",
            }
        )
    return out


def _campaigns(campaigns: dict[int, dict[str, Any]], now_minute_series: dict[str, Any]) -> list[dict[str, Any]]:
    """Each live campaign's counters now: the newest point of its series is the minute in progress."""
    out = []
    for campaign_id, row in campaigns.items():
        columns = now_minute_series["campaigns"].get(str(campaign_id), {})

        def newest(name: str, columns: dict[str, Any] = columns) -> float | None:
            values = [v for v in columns.get(name, []) if v is not None]
            return values[-1] if values else None

        val_loss = row["val_loss"]
        out.append(
            {
                "id": campaign_id,
                "name": row["name"],
                "state": row["state"],
                "committed_steps": row["committed_steps"],
                "version": row["version"],
                "steps_per_min": newest("steps_per_min"),
                "samples_per_s": newest("samples_per_s"),
                "training_loss": newest("loss"),
                "validation_loss": val_loss if val_loss is not None and math.isfinite(val_loss) else None,
            }
        )
    return out


def _lease_reasons(now: Any) -> list[dict[str, Any]]:
    """Lease outcomes of the last hour by state and reason, summed over every process's minute rows."""
    totals: dict[tuple[str, str], int] = {}
    rows = DashboardSample.objects.filter(minute__gte=now - REASONS_WINDOW).exclude(source=SITE)
    # Plus what this process counted since its last minute row (the others' come with their next row).
    for data in [*rows.values_list("data", flat=True), {"outcomes": history.outcome_deltas.peek()}]:
        for states in data.get("outcomes", {}).values():
            for state, reasons in states.items():
                for reason, count in reasons.items():
                    totals[(state, reason)] = totals.get((state, reason), 0) + count
    return [
        {"state": state, "reason": reason or "-", "count": count}
        for (state, reason), count in sorted(totals.items(), key=lambda item: (-item[1], item[0]))
    ]


def build() -> dict[str, Any]:
    """Everything the dashboard shows, as of now (see the module docstring for the cost)."""
    now = timezone.now()
    alerts = health.evaluate(now)
    online = swarm.online()
    campaigns = history.live_campaigns()
    series = history.series(campaigns, online.count, now)
    clock = hot_state().clock()
    return {
        "at": now.timestamp(),
        "push_s": settings.CROWDTRAIN_DASHBOARD_PUSH_S,
        "status": health.status_of(alerts),
        "summary": health.summary(alerts),
        "alerts": [a.as_dict() for a in alerts],
        "agents": {
            "online": online.count,
            "by_kind": online.by_kind,
            "recent": swarm.most_recently_seen(),
            "gone_after_s": settings.CROWDTRAIN_GONE_AFTER_S,
        },
        "aggregators": _aggregators(),
        "campaigns": _campaigns(campaigns, series),
        "lease_reasons": _lease_reasons(now),
        "celery": {
            "queue": celery_queue_depth(),
            "failures": [
                {"task": name, "count": count, "last_s_ago": max(0.0, clock - at)}
                for name, (count, at) in sorted(task_failures.failures().items())
            ],
        },
        "errors": recent_errors.recent(),
        "series": series,
    }


class _Shared:
    """One snapshot per process per ``SHARE_S``: ten admins watching cost what one does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at = 0.0
        self._value: dict[str, Any] | None = None

    def get(self) -> dict[str, Any]:
        with self._lock:
            if self._value is not None and time.monotonic() - self._at < SHARE_S:
                return self._value
        value = build()
        with self._lock:
            self._at, self._value = time.monotonic(), value
        return value

    def clear(self) -> None:
        with self._lock:
            self._at, self._value = 0.0, None


shared = _Shared()


def snapshot() -> dict[str, Any]:
    """The dashboard's current snapshot (built at most once per ``SHARE_S`` in this process)."""
    return shared.get()
