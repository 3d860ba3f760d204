"""Gauges read at scrape time from the database and Redis: what the dashboards show of campaigns and volunteers.

A scrape costs a fixed handful of aggregate queries and Redis reads, whatever the
number of volunteers or leases: counts are ``GROUP BY``s on indexed columns, and
the newest step and validation loss of each campaign are one lookup each through
their unique indexes. Only campaigns running or paused get per-campaign series.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from django.db.models import Count, OuterRef, Subquery, Sum
from django.db.models.fields.json import KT
from django.utils import timezone
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.models import Campaign, Step, ValidationResult
from crowdtrain.scheduler.durability import durability
from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain.scheduler.models import Aggregator, Lease, SliceAssignment
from crowdtrain.verification.models import Check, KeptVersion, Standing

from . import health, heartbeats, task_failures

LIVE_STATES = (Campaign.State.RUNNING, Campaign.State.PAUSED)
# Presence ids looked up per query when counting agents by accelerator (as housekeeping batches them).
KIND_BATCH = 5000


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _agents() -> Iterator[Metric]:
    state = hot_state()
    online_ids = state.online_ids()
    yield _gauge_value("crowdtrain_agents_online", "Agents holding a socket to the site now", len(online_ids))
    by_kind: dict[str, int] = {}
    for start in range(0, len(online_ids), KIND_BATCH):
        batch = online_ids[start : start + KIND_BATCH]
        rows = Device.objects.filter(pk__in=batch).values(kind=KT("hardware__kind")).annotate(n=Count("id"))
        for row in rows:
            kind = str(row["kind"] or "unknown")
            by_kind[kind] = by_kind.get(kind, 0) + row["n"]
    kinds = _gauge("crowdtrain_agents_online_by_kind", "Agents online by accelerator kind (cuda, mps, cpu)", ["kind"])
    for kind, count in sorted(by_kind.items()):
        kinds.add_metric([kind], count)
    yield kinds


def _gauge_value(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _campaigns() -> Iterator[Metric]:
    states = _gauge("crowdtrain_campaigns", "Campaigns by state", ["state"])
    counted = dict(Campaign.objects.values_list("state").annotate(n=Count("id")).values_list("state", "n"))
    for state in Campaign.State.values:
        states.add_metric([state], counted.get(state, 0))
    yield states

    newest_step = Step.objects.filter(campaign=OuterRef("pk")).order_by("-index")
    newest_val = ValidationResult.objects.filter(campaign=OuterRef("pk"), loss__isnull=False).order_by("-version")
    live = list(
        Campaign.objects.filter(state__in=LIVE_STATES)
        .annotate(
            step_loss_sum=Subquery(newest_step.values("loss_sum")[:1]),
            step_samples=Subquery(newest_step.values("num_samples")[:1]),
            val_loss=Subquery(newest_val.values("loss")[:1]),
        )
        .values("id", "name", "state", "committed_steps", "version", "step_loss_sum", "step_samples", "val_loss")
        .order_by("id")
    )
    ids = [c["id"] for c in live]
    samples = dict(
        Step.objects.filter(campaign_id__in=ids)
        .values("campaign_id")
        .annotate(n=Sum("num_samples"))
        .values_list("campaign_id", "n")
    )
    active = dict(
        Lease.objects.filter(campaign_id__in=ids, state=Lease.State.ACTIVE)
        .values("campaign_id")
        .annotate(n=Count("id"))
        .values_list("campaign_id", "n")
    )
    info = _gauge("crowdtrain_campaign_info", "A running or paused campaign's name and state (always 1)",
                  ["campaign", "name", "state"])  # fmt: skip
    steps = _gauge("crowdtrain_campaign_committed_steps", "Steps the scheduler has committed", ["campaign"])
    version = _gauge("crowdtrain_campaign_version", "Steps every aggregator has applied", ["campaign"])
    total = CounterMetricFamily("crowdtrain_campaign_samples", "Samples in committed steps", labels=["campaign"])
    loss = _gauge("crowdtrain_campaign_training_loss", "Mean training loss of the newest committed step", ["campaign"])
    val = _gauge("crowdtrain_campaign_validation_loss", "Held-out loss of the newest validated version", ["campaign"])
    leases = _gauge("crowdtrain_leases_active", "Leases out with agents now (as the database has recorded them)",
                    ["campaign"])  # fmt: skip
    for c in live:
        label = [str(c["id"])]
        info.add_metric([*label, c["name"], c["state"]], 1)
        steps.add_metric(label, c["committed_steps"])
        version.add_metric(label, c["version"])
        total.add_metric(label, samples.get(c["id"]) or 0)
        leases.add_metric(label, active.get(c["id"], 0))
        if c["step_samples"]:
            loss.add_metric(label, c["step_loss_sum"] / c["step_samples"])
        if c["val_loss"] is not None and math.isfinite(c["val_loss"]):
            val.add_metric(label, c["val_loss"])
    lag = _gauge("crowdtrain_campaign_checkpoint_lag_steps",
                 "Committed steps since the newest complete checkpoint: what an aggregator's crash would cost",
                 ["campaign"])  # fmt: skip
    for campaign in Campaign.objects.filter(pk__in=ids, checkpoint_every__gt=0).order_by("id"):
        lag.add_metric([str(campaign.pk)], durability(campaign).lag)
    yield from (info, steps, version, total, loss, val, leases, lag)


def _aggregators() -> Iterator[Metric]:
    rows = list(Aggregator.objects.values_list("id", "name", "connected").order_by("id"))
    running_slices = dict(
        SliceAssignment.objects.filter(campaign__state=Campaign.State.RUNNING)
        .values("aggregator_id")
        .annotate(n=Count("id"))
        .values_list("aggregator_id", "n")
    )
    heard = heartbeats.heard_at()
    now = hot_state().clock()
    yield _gauge_value(
        "crowdtrain_aggregators_connected", "Aggregators with a socket to the site", sum(1 for r in rows if r[2])
    )
    connected = _gauge("crowdtrain_aggregator_connected", "1 while the aggregator's socket is open", ["aggregator"])
    age = _gauge("crowdtrain_aggregator_heartbeat_age_seconds", "Seconds since the aggregator's last heartbeat",
                 ["aggregator"])  # fmt: skip
    # The silent-aggregator alert judges only these, as crowdtrain.ops.health does: a token whose
    # aggregator never started, or one whose campaigns finished, stalls nothing.
    slices = _gauge("crowdtrain_aggregator_running_slices", "Slices of running campaigns the aggregator holds",
                    ["aggregator"])  # fmt: skip
    for aggregator_id, name, is_connected in rows:
        connected.add_metric([name], int(is_connected))
        slices.add_metric([name], running_slices.get(aggregator_id, 0))
        if aggregator_id in heard:
            age.add_metric([name], max(0.0, now - heard[aggregator_id]))
    yield connected
    yield age
    yield slices


def _verification() -> Iterator[Metric]:
    quarantined = Standing.objects.filter(state=Standing.State.QUARANTINED).count()
    yield _gauge_value("crowdtrain_volunteers_quarantined", "Volunteers in quarantine, waiting for review", quarantined)
    checks = _gauge("crowdtrain_verification_checks", "Verification checks by state", ["state"])
    counted = dict(Check.objects.values_list("state").annotate(n=Count("id")).values_list("state", "n"))
    for state in Check.State.values:
        checks.add_metric([state], counted.get(state, 0))
    yield checks
    hour_ago = timezone.now() - timedelta(hours=1)
    ruled = Check.objects.filter(refereed_at__gte=hour_ago).count()
    yield _gauge_value("crowdtrain_referee_rulings_last_hour", "Leases the referee recomputed in the last hour", ruled)
    kept = KeptVersion.objects.count()
    yield _gauge_value("crowdtrain_referee_kept_versions", "Parameter versions the site keeps for open checks", kept)


def _alerts() -> Iterator[Metric]:
    firing = _gauge("crowdtrain_alert", "1 for each alert firing now (crowdtrain.ops.health)",
                    ["code", "campaign", "severity"])  # fmt: skip
    for alert in health.evaluate():
        campaign = "" if alert.campaign_id is None else str(alert.campaign_id)
        firing.add_metric([alert.code, campaign, alert.severity], 1)
    yield firing
    failures = CounterMetricFamily("crowdtrain_celery_task_failures", "Celery task failures, from every worker",
                                   labels=["task"])  # fmt: skip
    last = _gauge("crowdtrain_celery_task_last_failure_timestamp_seconds", "Unix time of a task's last failure",
                  ["task"])  # fmt: skip
    for name, (count, at) in sorted(task_failures.failures().items()):
        failures.add_metric([name], count)
        last.add_metric([name], at)
    yield failures
    yield last


class SiteCollector(Collector):
    """Everything ``/metrics`` reads at scrape time; see the module docstring for its cost."""

    def collect(self) -> Iterator[Metric]:
        yield from _agents()
        yield from _campaigns()
        yield from _aggregators()
        yield from _verification()
        yield from _alerts()

    def describe(self) -> list[Any]:
        return []  # no queries at registration time


_registered: set[int] = set()


def register(registry: CollectorRegistry) -> None:
    """Add the site's scrape-time collector to ``registry`` once."""
    if id(registry) not in _registered:
        registry.register(SiteCollector())
        _registered.add(id(registry))
