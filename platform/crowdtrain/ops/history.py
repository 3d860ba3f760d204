"""The dashboard's time series: one ``DashboardSample`` a minute, written by site housekeeping, served downsampled.

Why housekeeping and not Celery beat: every deployment runs site processes
(the embedded ``make serve`` has no beat), and the lease-outcome counters
live in those processes' memory (``lib.metrics``): only they can say what
they counted. Each process writes its own outcome row for the minute; the
first to get there also writes the swarm-wide row, the others skip it.

Steps, samples and losses are read back from the ``Step`` rows of each
running campaign through its ``(campaign, index)`` index, so a minute missed
(no process was up) is still counted right at the next sample. A week of
minutes is downsampled to at most ``MAX_POINTS`` buckets when served.
"""

from __future__ import annotations

import math
import os
import socket
import threading
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.db.models import OuterRef, Subquery
from django.utils import timezone

from crowdtrain.campaigns.models import Campaign, Step, ValidationResult
from crowdtrain.lib.metrics import LEASE_OUTCOMES

from . import swarm
from .models import SITE, DashboardSample

WEEK = timedelta(days=7)
KEEP = timedelta(days=8)  # rows older than this are deleted as new ones are written
MAX_POINTS = 720  # per series: a week at 14-minute buckets, an hour at 1-minute buckets
LIVE_MINUTES = 10  # minutes not sampled yet that a snapshot computes live from the steps
STEP_LOOKBACK = 20000  # newest steps of a campaign one read looks at, at most (through the unique index)
OUTCOME_STATES = ("accepted", "expired", "released", "rejected")


def minute_of(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


def live_campaigns() -> dict[int, dict[str, Any]]:
    """Running and paused campaigns: id -> name, state, committed steps, newest validation loss."""
    newest_val = ValidationResult.objects.filter(campaign=OuterRef("pk"), loss__isnull=False).order_by("-version")
    rows = (
        Campaign.objects.filter(state__in=(Campaign.State.RUNNING, Campaign.State.PAUSED))
        .annotate(val_loss=Subquery(newest_val.values("loss")[:1]))
        .values("id", "name", "state", "committed_steps", "version", "val_loss")
        .order_by("id")
    )
    return {row["id"]: dict(row) for row in rows}


def steps_by_minute(campaigns: dict[int, dict[str, Any]], since: datetime) -> dict[int, dict[datetime, list[float]]]:
    """Per campaign and minute since ``since``: [steps, samples, loss_sum] of the steps committed in it."""
    out: dict[int, dict[datetime, list[float]]] = {}
    for campaign_id, row in campaigns.items():
        minutes: dict[datetime, list[float]] = {}
        recent = Step.objects.filter(
            campaign_id=campaign_id, index__gt=row["committed_steps"] - STEP_LOOKBACK, committed_at__gte=since
        ).values_list("num_samples", "loss_sum", "committed_at")
        for num_samples, loss_sum, committed_at in recent:
            bucket = minutes.setdefault(minute_of(committed_at), [0.0, 0.0, 0.0])
            bucket[0] += 1
            bucket[1] += num_samples
            bucket[2] += loss_sum
        out[campaign_id] = minutes
    return out


class OutcomeDeltas:
    """Lease outcomes this process counted since its last sample, read from the Prometheus counter."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str, str], float] = {}

    def take(self) -> dict[str, dict[str, dict[str, int]]]:
        """campaign -> state -> reason label -> count, since the previous call."""
        return self._since_last(reset=True)

    def peek(self) -> dict[str, dict[str, dict[str, int]]]:
        """What ``take`` would return now, without moving the mark (the minute in progress, live)."""
        return self._since_last(reset=False)

    def _since_last(self, *, reset: bool) -> dict[str, dict[str, dict[str, int]]]:
        current: dict[tuple[str, str, str], float] = {}
        for metric in LEASE_OUTCOMES.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    labels = sample.labels
                    current[(labels["campaign"], labels["state"], labels["reason"])] = sample.value
        out: dict[str, dict[str, dict[str, int]]] = {}
        with self._lock:
            for key, value in current.items():
                delta = int(value - self._last.get(key, 0.0))
                if delta > 0:
                    campaign, state, reason = key
                    out.setdefault(campaign, {}).setdefault(state, {})[reason] = delta
            if reset:
                self._last = current
        return out


outcome_deltas = OutcomeDeltas()


def _process_source() -> str:
    return f"process:{socket.gethostname()}:{os.getpid()}"[:100]


def _site_row(minute: datetime, campaigns: dict[int, dict[str, Any]]) -> dict[str, Any]:
    online = swarm.online()
    joins, departures = swarm.joins_and_departures()
    steps = steps_by_minute(campaigns, minute)
    per_campaign = {}
    for campaign_id, row in campaigns.items():
        count, samples, loss_sum = steps[campaign_id].get(minute, [0.0, 0.0, 0.0])
        per_campaign[str(campaign_id)] = {
            "steps": int(count),
            "samples": int(samples),
            "loss_sum": loss_sum,
            "val_loss": row["val_loss"] if row["val_loss"] is not None and math.isfinite(row["val_loss"]) else None,
        }
    return {
        "agents": online.count,
        "by_kind": online.by_kind,
        "joins": joins,
        "departures": departures,
        "campaigns": per_campaign,
    }


def record_minute(now: datetime | None = None) -> bool:
    """Write the minute that just ended: this process's lease outcomes, and the swarm's row if nobody has.

    Called by each site process's housekeeping about once a minute; calling it
    again within the same minute writes nothing new. Returns whether the
    swarm-wide row was written by this call.
    """
    now = now or timezone.now()
    minute = minute_of(now) - timedelta(minutes=1)
    rows = []
    outcomes = outcome_deltas.take()
    if outcomes:
        rows.append(DashboardSample(minute=minute, source=_process_source(), data={"outcomes": outcomes}))
    wrote_site = not DashboardSample.objects.filter(minute=minute, source=SITE).exists()
    if wrote_site:
        rows.append(DashboardSample(minute=minute, source=SITE, data=_site_row(minute, live_campaigns())))
    # Another process may have written the same minute between our check and here: its row stands.
    DashboardSample.objects.bulk_create(rows, ignore_conflicts=True)
    if wrote_site:
        DashboardSample.objects.filter(minute__lt=now - KEEP).delete()
    return wrote_site


# ------------------------------------------------------------------ serving


def _bucket_minutes(first: datetime, last: datetime) -> int:
    span = int((last - first).total_seconds() // 60) + 1
    return max(1, math.ceil(span / MAX_POINTS))


def _downsample(rows: Iterable[tuple[datetime, str, dict[str, Any]]], now: datetime) -> dict[str, Any]:
    """Sum the rows of each bucket; rates are per minute or per second of the bucket's minutes."""
    rows = list(rows)
    if not rows:
        return {"bucket_s": 60, "minutes": []}
    first = rows[0][0]
    width = _bucket_minutes(first, minute_of(now))
    buckets: dict[datetime, dict[str, Any]] = {}
    for minute, source, data in rows:
        offset = int((minute - first).total_seconds() // 60) // width
        start = first + timedelta(minutes=offset * width)
        bucket = buckets.setdefault(
            start,
            {"t": start, "site_minutes": 0, "agents": 0, "joins": 0, "departures": 0,
             "outcomes": {s: 0 for s in OUTCOME_STATES}, "campaigns": {}},
        )  # fmt: skip
        if source == SITE:
            bucket["site_minutes"] += 1
            bucket["agents"] = max(bucket["agents"], data.get("agents", 0))  # the peak: a week stays readable
            bucket["joins"] += data.get("joins", 0)
            bucket["departures"] += data.get("departures", 0)
            for campaign_id, c in data.get("campaigns", {}).items():
                into = bucket["campaigns"].setdefault(campaign_id, {"steps": 0, "samples": 0, "loss_sum": 0.0,
                                                                   "minutes": 0, "val_loss": None})  # fmt: skip
                into["steps"] += c["steps"]
                into["samples"] += c["samples"]
                into["loss_sum"] += c["loss_sum"]
                into["minutes"] += 1
                if c.get("val_loss") is not None:
                    into["val_loss"] = c["val_loss"]
        else:
            for states in data.get("outcomes", {}).values():
                for state, reasons in states.items():
                    if state in bucket["outcomes"]:
                        bucket["outcomes"][state] += sum(reasons.values())
    return {"bucket_s": width * 60, "minutes": [buckets[k] for k in sorted(buckets)]}


class _HistoryCache:
    """The downsampled stored week, rebuilt only when a newer minute has been written (about once a minute)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[datetime | None, int] | None = None
        self._value: dict[str, Any] = {}

    def get(self, now: datetime) -> dict[str, Any]:
        newest = DashboardSample.objects.order_by("-minute").values_list("minute", flat=True).first()
        count = DashboardSample.objects.filter(minute=newest).count() if newest else 0
        key = (newest, count)
        with self._lock:
            if key == self._key and self._value:
                return self._value
        rows = DashboardSample.objects.filter(minute__gte=minute_of(now) - WEEK).values_list("minute", "source", "data")
        value = _downsample(rows.order_by("minute"), now)
        value["newest"] = newest
        with self._lock:
            self._key, self._value = key, value
        return value

    def clear(self) -> None:
        with self._lock:
            self._key, self._value = None, {}


history_cache = _HistoryCache()


def series(campaigns: dict[int, dict[str, Any]], agents_now: int, now: datetime | None = None) -> dict[str, Any]:
    """The charts' data: stored buckets, then the minutes not sampled yet, computed live from the steps.

    Returns ``{"bucket_s", "t": [unix seconds], "agents", "joins", "departures",
    "outcomes": {state: [...]}, "campaigns": {id: {"steps_per_min", "samples_per_s",
    "loss", "val_loss"}}}``; every list is as long as ``t`` (None where a campaign
    has no value).
    """
    now = now or timezone.now()
    stored = history_cache.get(now)
    buckets = list(stored["minutes"])
    newest: datetime | None = stored.get("newest")
    live_since = max(minute_of(now) - timedelta(minutes=LIVE_MINUTES - 1),
                     newest + timedelta(minutes=1) if newest else datetime.min.replace(tzinfo=now.tzinfo))  # fmt: skip
    live = steps_by_minute(campaigns, live_since)
    # Lease outcomes not sampled yet: this process's own (the others' arrive with their minute rows).
    unsampled = {s: 0 for s in OUTCOME_STATES}
    for states in outcome_deltas.peek().values():
        for state, reasons in states.items():
            if state in unsampled:
                unsampled[state] += sum(reasons.values())
    minute = live_since
    while minute <= now:
        elapsed = min(60.0, (now - minute).total_seconds())
        if elapsed >= 1.0:
            bucket: dict[str, Any] = {"t": minute, "site_minutes": elapsed / 60, "joins": None,
                                      # Only the minute in progress knows its agents: it is now.
                                      "agents": agents_now if minute == minute_of(now) else None,
                                      "departures": None, "outcomes": {}, "campaigns": {}}  # fmt: skip
            for campaign_id, row in campaigns.items():
                count, samples, loss_sum = live.get(campaign_id, {}).get(minute, [0.0, 0.0, 0.0])
                bucket["campaigns"][str(campaign_id)] = {
                    "steps": count, "samples": samples, "loss_sum": loss_sum, "minutes": elapsed / 60,
                    "val_loss": row["val_loss"],
                }  # fmt: skip
            buckets.append(bucket)
        minute += timedelta(minutes=1)
    if buckets and buckets[-1]["joins"] is None:  # the minute in progress
        buckets[-1]["outcomes"] = unsampled
    return _columns(buckets, stored["bucket_s"], campaigns)


def _columns(buckets: list[dict[str, Any]], bucket_s: int, campaigns: dict[int, dict[str, Any]]) -> dict[str, Any]:
    ids = sorted({cid for b in buckets for cid in b["campaigns"]} | {str(c) for c in campaigns}, key=int)
    out: dict[str, Any] = {
        "bucket_s": bucket_s,
        "t": [int(b["t"].timestamp()) for b in buckets],
        "agents": [b["agents"] for b in buckets],
        "joins": [b["joins"] for b in buckets],
        "departures": [b["departures"] for b in buckets],
        "outcomes": {s: [b["outcomes"].get(s) for b in buckets] for s in OUTCOME_STATES},
        "campaigns": {},
    }
    for cid in ids:
        steps_per_min, samples_per_s, loss, val_loss = [], [], [], []
        for b in buckets:
            c = b["campaigns"].get(cid)
            minutes = c["minutes"] if c else 0
            steps_per_min.append(c["steps"] / minutes if c and minutes else None)
            samples_per_s.append(c["samples"] / (minutes * 60) if c and minutes else None)
            loss.append(c["loss_sum"] / c["samples"] if c and c["samples"] else None)
            val_loss.append(c["val_loss"] if c else None)
        out["campaigns"][cid] = {"steps_per_min": steps_per_min, "samples_per_s": samples_per_s, "loss": loss,
                                 "val_loss": val_loss}  # fmt: skip
    return out
