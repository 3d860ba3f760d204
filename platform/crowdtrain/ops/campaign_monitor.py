"""What the organizer's campaign page shows, live: the campaign as it really is, not its state field.

``RUNNING`` says what the organizer asked for, not what happens: a running
campaign may wait for aggregators, have lost one, have no volunteer, or have
stopped stepping. ``condition`` says which, with the same judgement the admin
dashboard and ``/healthz`` use (``ops.health``), so the three never disagree.

Everything here is read by a page that polls every few seconds, so its cost
is bounded by the campaign's own size: the loss and throughput series are
downsampled to at most ``MAX_POINTS`` points by the database and cached until
the next step, contributors come from the leaderboard's sorted sets, and the
active leases are one indexed query with a limit. The network figures are two
sums over one small row per step (``StepNetwork``), cached until the next step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.cache import cache
from django.db.models import F, Max, Sum
from django.utils import timezone
from django.utils.timesince import timesince

from crowdtrain.accounts.models import ANONYMOUS_NAME, Profile
from crowdtrain.campaigns.models import Campaign, Step
from crowdtrain.credit import boards
from crowdtrain.credit.models import FLOPS_PER_CREDIT, CreditEntry
from crowdtrain.scheduler.durability import durability
from crowdtrain.scheduler.models import Lease, SliceAssignment, StepNetwork

from . import health

MAX_POINTS = 600  # per series: a week of steps still draws quickly and reads as a curve
RECENT_STEPS = 20  # the steps whose pace estimates the time left and the live rate
# A running campaign with no lease out and no step for this long is waiting for volunteers.
IDLE_AFTER_S = 120.0
# A step newer than this keeps the live rate on; older, the campaign is not moving and says 0.
LIVE_RATE_WINDOW_S = 300.0
RATE_WINDOW = 10  # points the throughput curve averages over
CONTRIBUTORS_SHOWN = 10
LEASES_SHOWN = 10
SERIES_CACHE_S = 300  # keyed on the step count too: a new step is a new key

Level = str  # "ok" | "info" | "warning" | "critical"


@dataclass(frozen=True)
class Condition:
    """The campaign's real state: a short ``title``, a sentence with the numbers, and what to do about it."""

    code: str
    level: Level
    title: str
    text: str
    what_to_do: str = ""


def plural(count: int, one: str, many: str | None = None) -> str:
    """ "1 step", "2 steps": a sentence that names a count agrees with it."""
    return f"{count} {one if count == 1 else (many or one + 's')}"


def duration(seconds: float | None) -> str:
    """A span for people: "under a minute", "12 minutes", "3 hours, 20 minutes"."""
    if seconds is None or not math.isfinite(seconds):
        return "–"
    if seconds < 60:
        return "under a minute"
    now = timezone.now()
    return timesince(now - timedelta(seconds=seconds), now, depth=2)


def _why_finished(campaign: Campaign, latest_val: float | None) -> str:
    if campaign.max_steps is not None and campaign.committed_steps >= campaign.max_steps:
        return f"it made its {plural(campaign.max_steps, 'step')}"
    target = campaign.target_val_loss
    if target is not None and latest_val is not None and latest_val <= target:
        return f"its validation loss reached {latest_val:.3f} (target {target:g})"
    return "finished by hand"


def condition(
    campaign: Campaign,
    *,
    alerts: list[health.Alert],
    active_leases: int,
    last_step_at: datetime | None,
    latest_val: float | None,
    now: datetime,
) -> Condition:
    """What the campaign is doing now (see the module docstring)."""
    state = campaign.state
    if state == Campaign.State.DRAFT:
        return Condition(
            "draft", "info", "Draft", "Nobody trains it yet, and every setting can change.", "Start it when ready."
        )
    if state == Campaign.State.ARCHIVED:
        return Condition("archived", "info", "Archived", "It is kept for its exports; nothing more happens to it.")
    if state == Campaign.State.FINISHED:
        when = f" {duration((now - campaign.finished_at).total_seconds())} ago" if campaign.finished_at else ""
        text = (
            f"Finished{when} after {plural(campaign.committed_steps, 'step')}: {_why_finished(campaign, latest_val)}."
        )
        return Condition("finished", "info", "Finished", text, "Download the trained model below.")
    if state == Campaign.State.PAUSED:
        return Condition(
            "paused",
            "warning",
            "Paused",
            f"Agents get no new leases. {plural(active_leases, 'lease')} still out: each counts only if its agent "
            "reports it before its deadline, and the rest expire.",
            "Resume it to train again.",
        )
    by_code = {a.code: a for a in alerts}
    if health.CAMPAIGN_BLOCKED in by_code:
        alert = by_code[health.CAMPAIGN_BLOCKED]
        return Condition("blocked", "critical", "Blocked", campaign.blocked_reason, alert.what_to_do)
    if health.AGGREGATOR_SILENT in by_code:
        alert = by_code[health.AGGREGATOR_SILENT]
        return Condition(
            "aggregator_silent", "critical", "Stalled: an aggregator is silent", alert.message, alert.what_to_do
        )
    if health.CAMPAIGN_WAITING in by_code:
        slices = SliceAssignment.objects.filter(campaign=campaign)
        ready = slices.filter(ready=True).count()
        return Condition(
            "waiting_for_aggregators",
            "warning",
            f"Waiting for aggregators: {ready} of {plural(campaign.num_aggregators, 'slice')} ready",
            "Volunteers get no leases until every slice of the model has a live aggregator.",
            by_code[health.CAMPAIGN_WAITING].what_to_do,
        )
    behind = by_code.get(health.CHECKPOINTS_BEHIND)
    if behind is not None and behind.severity == "critical":
        return Condition("checkpoints_behind", "critical", "Waiting for checkpoints", behind.message, behind.what_to_do)
    if health.CAMPAIGN_STALLED in by_code:
        alert = by_code[health.CAMPAIGN_STALLED]
        return Condition("stalled", "critical", "Stalled", alert.message, alert.what_to_do)
    idle_s = (now - last_step_at).total_seconds() if last_step_at else None
    if active_leases == 0 and (idle_s is None or idle_s > IDLE_AFTER_S):
        return Condition(
            "waiting_for_volunteers",
            "warning",
            "Waiting for volunteers",
            "No agent is working on it right now.",
            "Share its join page: volunteers who follow it start training within a minute.",
        )
    if behind is not None:
        return Condition("checkpoints_behind", "warning", "Training, checkpoints behind", behind.message,
                         behind.what_to_do)  # fmt: skip
    if health.LEASE_FAILURES in by_code:
        alert = by_code[health.LEASE_FAILURES]
        return Condition(
            "lease_failures", "warning", "Training, with many failed leases", alert.message, alert.what_to_do
        )
    if last_step_at is None:
        return Condition(
            "training", "ok", "Training", f"{plural(active_leases, 'lease')} out; the first step is being computed."
        )
    return Condition("training", "ok", "Training", f"{plural(active_leases, 'lease')} out.")


def _bucketed_steps(campaign: Campaign) -> tuple[int, list[dict[str, Any]]]:
    """Steps per bucket, and the campaign's steps in at most ``MAX_POINTS`` such buckets, oldest first."""
    newest = campaign.steps.aggregate(n=Max("index"))["n"]
    width = max(1, math.ceil((newest + 1) / MAX_POINTS)) if newest is not None else 1
    rows = (
        Step.objects.filter(campaign=campaign)
        .annotate(bucket=F("index") / width)
        .values("bucket")
        .annotate(last=Max("index"), at=Max("committed_at"), samples=Sum("num_samples"), loss_total=Sum("loss_sum"))
        .order_by("bucket")
    )
    return width, [dict(row) for row in rows]


def series(campaign: Campaign) -> dict[str, Any]:
    """Loss by step and by wall time, validation loss, and samples/s, downsampled; cached until the next step.

    Steps are numbered as versions are: step ``n`` is the one that made version ``n``,
    so a validation result of version ``n`` sits on the same x as the loss of step ``n``.
    """
    key = f"campaign-series:{campaign.pk}:{campaign.committed_steps}:{campaign.version}:{campaign.hot_key}"
    cached = cache.get(key)
    if cached is not None:
        return cached
    width, buckets = _bucketed_steps(campaign)
    steps, times, losses, rates = [], [], [], []
    for i, b in enumerate(buckets):
        steps.append(b["last"] + 1)
        times.append(b["at"].timestamp())
        losses.append(b["loss_total"] / b["samples"] if b["samples"] else None)
        # Samples over the time since the commit RATE_WINDOW points back: one step's own rate swings
        # with every burst of reports. The first point has no earlier commit: no rate, not a made-up one.
        back = max(0, i - RATE_WINDOW)
        span = (b["at"] - buckets[back]["at"]).total_seconds()
        samples = sum(c["samples"] for c in buckets[back + 1 : i + 1])
        rates.append(samples / span if span > 0 else None)
    results = list(
        campaign.validation_results.filter(loss__isnull=False)
        .order_by("version")
        .values_list("version", "loss", "computed_at")
    )
    stride = max(1, math.ceil(len(results) / MAX_POINTS))
    kept = results[::stride]
    if results and kept[-1] is not results[-1]:
        kept.append(results[-1])  # the newest result is the one the organizer looks for
    out = {
        "step": steps,
        "time": times,
        "loss": losses,
        "samples_per_s": rates,
        "val_step": [v for v, _, _ in kept],
        "val_time": [t.timestamp() for _, _, t in kept],
        "val_loss": [loss for _, loss, _ in kept],
        "steps_per_point": width,
    }
    cache.set(key, out, SERIES_CACHE_S)
    return out


@dataclass(frozen=True)
class _Pace:
    last_step_at: datetime | None = None
    last_loss: float | None = None
    steps_per_s: float | None = None
    samples_per_s: float | None = None


def recent_pace(campaign: Campaign) -> _Pace:
    """The newest step (time, loss), and steps/s and samples/s over the last ``RECENT_STEPS`` steps."""
    recent = list(
        campaign.steps.order_by("-index").values_list("committed_at", "num_samples", "loss_sum")[: RECENT_STEPS + 1]
    )
    if not recent:
        return _Pace()
    newest, n, loss_sum = recent[0]
    last_loss = loss_sum / n if n else None
    span = (newest - recent[-1][0]).total_seconds()
    if len(recent) < 2 or span <= 0:
        return _Pace(newest, last_loss)
    return _Pace(newest, last_loss, (len(recent) - 1) / span, sum(r[1] for r in recent[:-1]) / span)


def progress(campaign: Campaign, pace: _Pace, *, latest_val: float | None, now: datetime) -> dict[str, Any]:
    """Progress toward the stop rule, elapsed time, the estimate of time left, and the rate.

    The live rate is shown only while the campaign runs and stepped lately; a finished one
    shows its average over the run instead (no rate "now" for a model that no longer trains).
    """
    samples = campaign.steps.aggregate(n=Sum("num_samples"))["n"] or 0
    started = campaign.started_at
    end = campaign.finished_at if campaign.state in (Campaign.State.FINISHED, Campaign.State.ARCHIVED) else None
    elapsed = ((end or now) - started).total_seconds() if started else None
    running = campaign.state == Campaign.State.RUNNING
    last_step_at = pace.last_step_at
    live = running and last_step_at is not None and (now - last_step_at).total_seconds() <= LIVE_RATE_WINDOW_S
    fraction = None
    eta_s = None
    eta_text = ""
    if campaign.max_steps:
        fraction = min(1.0, campaign.committed_steps / campaign.max_steps)
        left = max(0, campaign.max_steps - campaign.committed_steps)
        if running and live and pace.steps_per_s:
            eta_s = left / pace.steps_per_s
            eta_text = f"about {duration(eta_s)} left at the recent pace"
            if campaign.target_val_loss is not None:
                eta_text += " (sooner if the validation loss reaches its target)"
        elif running:
            eta_text = "no estimate until it steps again"
    elif campaign.target_val_loss is not None and running:
        eta_text = "no estimate: it stops when the validation loss reaches its target"
    elif running:
        eta_text = "no stop rule: it trains until you finish it"
    lag = durability(campaign)
    checkpoint_text = (
        f"version {lag.newest_complete}, {plural(lag.lag, 'step')} behind" if campaign.committed_steps else "none yet"
    )
    return {
        "committed_steps": campaign.committed_steps,
        # What a crash of an aggregator would cost now: the steps since the newest complete checkpoint.
        "checkpoint_lag": lag.lag,
        "checkpoint_text": checkpoint_text,
        "max_steps": campaign.max_steps,
        "fraction": fraction,
        "target_val_loss": campaign.target_val_loss,
        "train_loss": pace.last_loss,
        "val_loss": latest_val,
        "samples": samples,
        "elapsed_s": elapsed,
        "elapsed_text": duration(elapsed) if elapsed is not None else "not started",
        "eta_s": eta_s,
        "eta_text": eta_text,
        "live": live,
        "samples_per_s": (pace.samples_per_s or 0.0) if live else None,
        "average_samples_per_s": samples / elapsed if elapsed else None,
    }


def contributor_count(campaign: Campaign) -> int:
    """Volunteers with credit in the campaign: the leaderboard's count, as ``contributors`` gives it."""
    return boards.size(campaign.pk, "volunteers", "all")


def byte_size(count: float) -> str:
    """A byte count as people read it, in decimal units: "512 B", "4.1 kB", "41 kB", "1.2 GB"."""
    value, unit = float(count), "B"
    for bigger in ("kB", "MB", "GB", "TB"):
        if value < 999.5:
            break
        value, unit = value / 1000, bigger
    if unit == "B":
        return f"{value:.0f} B"
    return f"{value:.1f} {unit}" if value < 9.95 else f"{value:.0f} {unit}"


def _network_figures(sums: dict[str, Any]) -> dict[str, Any]:
    """Bytes per sample and the network's share of time, from ``StepNetwork`` sums (see its docstring)."""
    samples = sums["samples"] or 0
    unreported = sums["unreported"] or 0
    if not samples:
        return {
            "samples": 0,
            "unreported_samples": unreported,
            "bytes_up_per_sample": None,
            "bytes_down_per_sample": None,
            "network_share": None,
            "per_sample_text": "unknown: the agents are too old to report it" if unreported else "no reports yet",
            "share_text": "–",
            "unreported_text": "",
        }
    up, down = (sums["bytes_up"] or 0) / samples, (sums["bytes_down"] or 0) / samples
    network_s, compute_s = sums["network_s"] or 0.0, sums["compute_s"] or 0.0
    share = network_s / (network_s + compute_s) if network_s + compute_s > 0 else None
    unreported_text = ""
    if unreported:
        # Unknown is not free: those samples are left out of the figures, not counted as costing nothing.
        unreported_text = (
            f"{unreported / (samples + unreported):.0%} of the samples came from agents too old to report "
            "their traffic; the figures are the other agents'."
        )
    return {
        "samples": samples,
        "unreported_samples": unreported,
        "bytes_up_per_sample": up,
        "bytes_down_per_sample": down,
        "network_share": share,
        "per_sample_text": f"{byte_size(up)} up, {byte_size(down)} down per sample",
        "share_text": f"{share:.0%}" if share is not None else "–",
        "unreported_text": unreported_text,
    }


def network(campaign: Campaign) -> dict[str, Any]:
    """What the campaign costs its volunteers' links: bytes per sample each way and the network's share of
    the swarm's time, over the last ``RECENT_STEPS`` steps and over the run; cached until the next step.

    The share is the time agents waited on the network over that time plus their compute time, summed
    over the reporting leases: how much faster the swarm would be on an infinitely fast network.
    """
    key = f"campaign-network:{campaign.pk}:{campaign.committed_steps}:{campaign.version}:{campaign.hot_key}"
    cached = cache.get(key)
    if cached is None:
        sums = {
            "samples": Sum("samples"),
            "unreported": Sum("unreported_samples"),
            "bytes_up": Sum("bytes_up"),
            "bytes_down": Sum("bytes_down"),
            "network_s": Sum("network_s"),
            "compute_s": Sum("compute_s"),
        }
        rows = StepNetwork.objects.filter(campaign=campaign)
        recent = rows.filter(step__index__gte=campaign.committed_steps - RECENT_STEPS)
        cached = {
            "recent": _network_figures(recent.aggregate(**sums)),
            "run": _network_figures(rows.aggregate(**sums)),
            "recent_text": f"last {plural(RECENT_STEPS, 'step')}",
        }
        cache.set(key, cached, SERIES_CACHE_S)
    mode = campaign.training_mode
    return {
        **cached,
        "codec": campaign.codec,
        "training_mode": mode,
        "training_mode_text": campaign.get_training_mode_display(),
    }


def contributors(campaign: Campaign) -> dict[str, Any]:
    """How many volunteers have credit here, and the top ones with their share of the campaign's credit.

    From the leaderboard (one sorted set per campaign): the same numbers the public board shows,
    and work taken back after a failed check is not counted.
    """
    rows, count = boards.page(campaign.pk, "volunteers", "all", 0, CONTRIBUTORS_SHOWN)
    flops = CreditEntry.objects.filter(campaign=campaign).aggregate(f=Sum("flops"))["f"] or 0.0
    total = flops / FLOPS_PER_CREDIT
    # Public names only: a display name or "Anonymous", never an e-mail address.
    profiles = {p.user_id: p.public_name for p in Profile.objects.filter(user_id__in=[r.subject_id for r in rows])}
    top = []
    for r in rows:
        share = (r.credit / total) if total > 0 else None
        top.append(
            {
                "rank": r.rank,
                "name": profiles.get(r.subject_id, ANONYMOUS_NAME),
                "credit": round(r.credit, 3),
                "share": share,
                "share_pct": round(min(1.0, share) * 100, 1) if share is not None else 0.0,
                "share_text": f"{share:.0%}" if share is not None else "–",
            }
        )
    shown = sum(r.credit for r in rows)
    others = max(0, count - len(rows))
    others_share = max(0.0, (total - shown) / total) if total > 0 and others else None
    others_text = ""
    if others:
        others_text = f"and {plural(others, 'more volunteer')}"
        if others_share is not None:
            others_text += f", with {others_share:.0%} of the work"
    return {
        "count": count,
        "count_text": plural(count, "contributor"),
        "top": top,
        "others": others,
        "others_share": others_share,
        "others_text": others_text,
    }


def active_leases(campaign: Campaign, now: datetime) -> dict[str, Any]:
    """Leases out now: how many, and the newest few (who, how many samples, how long left)."""
    out = campaign.leases.filter(state=Lease.State.ACTIVE)
    newest = list(
        out.order_by("-issued_at").values("id", "num_samples", "issued_at", "deadline", "device__owner_id")[
            :LEASES_SHOWN
        ]
    )
    # Counted from the rows when they are all there: a second query could see a lease the first did not.
    count = len(newest) if len(newest) < LEASES_SHOWN else out.count()
    owners = {r["device__owner_id"] for r in newest}
    names = {p.user_id: p.public_name for p in Profile.objects.filter(user_id__in=owners)}
    return {
        "count": count,
        "count_text": plural(count, "lease"),
        "rows": [
            {
                "id": r["id"],
                "volunteer": names.get(r["device__owner_id"], ANONYMOUS_NAME),
                "samples": r["num_samples"],
                "age_s": max(0.0, (now - r["issued_at"]).total_seconds()),
                "age_text": duration(max(0.0, (now - r["issued_at"]).total_seconds())),
                "deadline_in_s": (r["deadline"] - now).total_seconds(),
                "deadline_text": (
                    duration((r["deadline"] - now).total_seconds()) if r["deadline"] > now else "passed, expiring"
                ),
            }
            for r in newest
        ],
    }


def snapshot(campaign: Campaign, now: datetime | None = None) -> dict[str, Any]:
    """Everything the organizer's page draws, as JSON (the page's feed and its first render)."""
    now = now or timezone.now()
    pace = recent_pace(campaign)
    newest_val = (
        campaign.validation_results.filter(loss__isnull=False)
        .order_by("-version")
        .values_list("loss", flat=True)
        .first()
    )
    leases = active_leases(campaign, now)
    alerts = health.evaluate_campaign(campaign.pk, now)
    found = condition(
        campaign,
        alerts=alerts,
        active_leases=leases["count"],
        last_step_at=pace.last_step_at,
        latest_val=newest_val,
        now=now,
    )
    return {
        "id": campaign.pk,
        "state": campaign.state,
        "condition": asdict(found),
        "progress": progress(campaign, pace, latest_val=newest_val, now=now),
        "series": series(campaign),
        "contributors": contributors(campaign),
        "leases": leases,
        "network": network(campaign),
    }
