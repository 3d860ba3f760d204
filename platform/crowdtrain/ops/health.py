"""What is wrong with the site right now, as alerts an operator can act on: ``/healthz`` and ``crowdtrain_alert``.

One evaluation feeds the health check, the ``crowdtrain_alert`` gauge of
``/metrics`` and the admin dashboard, so they never disagree. Its cost grows
with running campaigns and aggregators, never with volunteers or leases: a few
aggregate queries, two Redis reads, and two more per campaign that stepped no
step for a while (are volunteers there?). deploy/prometheus/alerts.yml states the
same conditions in PromQL: ``alert_rules`` writes it from the codes and thresholds here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from django.conf import settings
from django.db.models import OuterRef, Subquery
from django.utils import timezone

from crowdtrain.campaigns.models import Campaign, Step
from crowdtrain.lib.metrics import WINDOW_S, outcomes
from crowdtrain.scheduler.durability import durability
from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain.scheduler.models import SliceAssignment

from . import heartbeats, task_failures

Severity = Literal["critical", "warning"]

# A campaign needs this many lease outcomes in the window before its failure share means anything.
MIN_OUTCOMES = 20
TASK_FAILURE_WINDOW_S = 900.0  # a Celery task that failed in the last 15 minutes

AGGREGATOR_SILENT = "aggregator_silent"
CAMPAIGN_WAITING = "campaign_waiting_for_aggregators"
CAMPAIGN_BLOCKED = "campaign_blocked"
CAMPAIGN_STALLED = "campaign_stalled"
CAMPAIGN_NO_VOLUNTEERS = "campaign_waiting_for_volunteers"
CHECKPOINTS_BEHIND = "campaign_checkpoints_behind"
LEASE_FAILURES = "lease_failures_spike"
TASK_FAILING = "celery_task_failing"
CODES = (
    AGGREGATOR_SILENT,
    CAMPAIGN_WAITING,
    CAMPAIGN_BLOCKED,
    CHECKPOINTS_BEHIND,
    CAMPAIGN_STALLED,
    CAMPAIGN_NO_VOLUNTEERS,
    LEASE_FAILURES,
    TASK_FAILING,
)
# What each alert means in a few words, for badges: the first of an evaluation's alerts, in this order, names it.
SUMMARIES = {
    AGGREGATOR_SILENT: "aggregator down",
    CAMPAIGN_BLOCKED: "campaign blocked",
    CAMPAIGN_WAITING: "waiting for aggregators",
    CHECKPOINTS_BEHIND: "checkpoints behind",
    CAMPAIGN_STALLED: "stalled with volunteers present",
    CAMPAIGN_NO_VOLUNTEERS: "no volunteers",
    LEASE_FAILURES: "many failed leases",
    TASK_FAILING: "a background task failing",
}


@dataclass(frozen=True)
class Alert:
    """One thing wrong: ``code`` (one of ``CODES``), the campaign it concerns (None: the whole site),
    what is wrong in words, with the values, and what an operator should do about it."""

    code: str
    severity: Severity
    campaign_id: int | None
    message: str
    what_to_do: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Running:
    id: int
    name: str
    num_aggregators: int
    blocked_reason: str
    last_step_at: datetime | None
    running_since: datetime | None


def _running_campaigns(campaign_id: int | None = None) -> list[_Running]:
    newest = Step.objects.filter(campaign=OuterRef("pk")).order_by("-index").values("committed_at")[:1]
    running = Campaign.objects.filter(state=Campaign.State.RUNNING)
    if campaign_id is not None:
        running = running.filter(pk=campaign_id)
    rows = (
        running.annotate(last_step_at=Subquery(newest))
        .values_list("id", "name", "num_aggregators", "blocked_reason", "last_step_at", "running_since")
        .order_by("id")
    )
    return [_Running(*row) for row in rows]


def _silent_aggregators(running: list[_Running]) -> tuple[list[Alert], dict[int, list[dict[str, Any]]]]:
    """Aggregators holding slices of running campaigns that are not connected or not heard from lately."""
    slices: dict[int, list[dict[str, Any]]] = {c.id: [] for c in running}
    for held in SliceAssignment.objects.filter(campaign_id__in=list(slices)).values(
        "campaign_id", "index", "ready", "aggregator_id", "aggregator__name", "aggregator__connected"
    ):
        slices[held["campaign_id"]].append(dict(held))
    heard = heartbeats.heard_at()
    now = hot_state().clock()
    gone_s = settings.CROWDTRAIN_GONE_AFTER_S
    alerts = []
    for campaign in running:
        silent = []
        for row in slices[campaign.id]:
            at = heard.get(row["aggregator_id"])
            if not row["aggregator__connected"]:
                since = f"last heard {now - at:.0f} s ago" if at is not None else "never heard from by this site"
                silent.append(f"{row['aggregator__name']} (slice {row['index']}: disconnected, {since})")
            elif at is not None and now - at > gone_s:
                silent.append(f"{row['aggregator__name']} (slice {row['index']}: no heartbeat for {now - at:.0f} s)")
        if silent:
            alerts.append(
                Alert(
                    AGGREGATOR_SILENT,
                    "critical",
                    campaign.id,
                    f"campaign {campaign.id} ({campaign.name!r}): aggregator {', '.join(silent)}; "
                    "its volunteers get no leases",
                    "check the aggregator's process and log on its host; restart it with the same --name "
                    "(python -m crowdtrain_backbone --name NAME) so the site gives it its slices back, "
                    "or start a replacement with that name: it resumes from the newest complete checkpoint",
                )
            )
    return alerts, slices


def _waiting_for_aggregators(
    running: list[_Running], slices: dict[int, list[dict[str, Any]]], silent: set[int]
) -> list[Alert]:
    alerts = []
    for campaign in running:
        if campaign.id in silent or campaign.blocked_reason:
            continue  # the silent aggregator or the block is the cause, and its alert says so
        held = slices[campaign.id]
        ready = sum(1 for row in held if row["ready"])
        if len(held) >= campaign.num_aggregators and ready == len(held):
            continue
        alerts.append(
            Alert(
                CAMPAIGN_WAITING,
                "critical",
                campaign.id,
                f"campaign {campaign.id} ({campaign.name!r}) is running with {ready} of its "
                f"{campaign.num_aggregators} aggregator slices ready; its volunteers get no leases",
                f"start aggregators until {campaign.num_aggregators} are connected (python -m crowdtrain_backbone "
                "with a token from manage.py create_backbone_token); one that is connected but not ready is "
                "loading a checkpoint: its log says which, and whether the checkpoint storage answers",
            )
        )
    return alerts


def _blocked(running: list[_Running]) -> list[Alert]:
    return [
        Alert(
            CAMPAIGN_BLOCKED,
            "critical",
            c.id,
            f"campaign {c.id} ({c.name!r}) is blocked: {c.blocked_reason}",
            "restore it to a complete checkpoint from the campaign's page (Restore), or pause it; "
            "it takes no work until then",
        )
        for c in running
        if c.blocked_reason
    ]


def _checkpoints_behind(running: list[_Running]) -> list[Alert]:
    """Campaigns whose newest complete checkpoint missed an interval (a warning) or reached the bound (critical:
    they take no work until one completes)."""
    alerts = []
    for campaign in Campaign.objects.filter(pk__in=[c.id for c in running], checkpoint_every__gt=0).order_by("id"):
        lag = durability(campaign)
        if not lag.late:
            continue
        what = "it takes no work until one completes" if lag.holding else "an aggregator's crash would cost those steps"
        alerts.append(
            Alert(
                CHECKPOINTS_BEHIND,
                "critical" if lag.holding else "warning",
                campaign.pk,
                f"campaign {campaign.pk} ({campaign.name!r}): the newest complete checkpoint is version "
                f"{lag.newest_complete}, {lag.lag} steps behind its committed steps (checkpoints every "
                f"{campaign.checkpoint_every}); {what}",
                "read the aggregators' logs for checkpoint errors and check their storage (the S3 endpoint and "
                "credentials, or the disk's free space); their /metrics count the failures "
                "(crowdtrain_backbone_checkpoint_failures_total). Training goes on by itself once a checkpoint "
                "of every slice is written",
            )
        )
    return alerts


def volunteers_present(running: list[_Running]) -> dict[int, int]:
    """Devices working on, or asking for work of, each running campaign now: two Redis reads per campaign.

    A device holding a lease, or one that asked within CROWDTRAIN_GONE_AFTER_S and got none, is present.
    """
    from crowdtrain.scheduler.configs import campaign_config

    state = hot_state()
    now = state.clock()
    ids, pipe = [], state.client.pipeline(transaction=False)
    for campaign in running:
        config = campaign_config(campaign.id)
        if config is None:
            continue
        key = state.campaign_key(config.hot_key)
        pipe.hlen(f"{key}hold")
        pipe.zcount(f"{key}idle", now - settings.CROWDTRAIN_GONE_AFTER_S, "+inf")
        ids.append(campaign.id)
    counts = pipe.execute() if ids else []
    return {campaign_id: int(counts[2 * i]) + int(counts[2 * i + 1]) for i, campaign_id in enumerate(ids)}


def _stalled(running: list[_Running], now: datetime, excused: set[int]) -> list[Alert]:
    """A running campaign that committed no step for a while: critical with volunteers present (something is
    broken), only a warning without any (nothing is wrong but the want of volunteers)."""
    after = timedelta(minutes=settings.CROWDTRAIN_STALLED_AFTER_MIN)
    alerts = []
    quiet = []
    for c in running:
        # Counted from the newest step, or from the start or resume when no step came since: a paused
        # campaign that was just resumed is not stalled for the time it spent paused.
        since = max((t for t in (c.last_step_at, c.running_since) if t is not None), default=None)
        if c.id in excused or since is None or now - since <= after:
            continue
        quiet.append((c, since))
    present = volunteers_present([c for c, _ in quiet]) if quiet else {}
    for c, since in quiet:
        minutes = (now - since).total_seconds() / 60
        what = "committed no step for" if since == c.last_step_at else "committed no step since it started running"
        if not present.get(c.id):
            alerts.append(
                Alert(
                    CAMPAIGN_NO_VOLUNTEERS,
                    "warning",
                    c.id,
                    f"campaign {c.id} ({c.name!r}) is running but no volunteer's agent is working on it or asking "
                    f"for its work; it {what} {minutes:.0f} minutes",
                    "invite volunteers (the campaign's join page), or pause it until some come; nothing is broken",
                )
            )
            continue
        alerts.append(
            Alert(
                CAMPAIGN_STALLED,
                "critical",
                c.id,
                f"campaign {c.id} ({c.name!r}) is running but {what} {minutes:.0f} minutes "
                f"(limit {settings.CROWDTRAIN_STALLED_AFTER_MIN:g})",
                "volunteers' agents are there but no step completes: leases that all expire or are rejected "
                "(the dashboard's lease outcomes) point at a broken agent version or dataset; otherwise read "
                "the site's log for the campaign's id",
            )
        )
    return alerts


def _lease_failures(running: list[_Running] | None = None) -> list[Alert]:
    """Campaigns whose leases fail too often (only those of ``running``, when given)."""
    share_limit = settings.CROWDTRAIN_LEASE_FAILURE_SHARE
    only = None if running is None else {c.id for c in running}
    alerts = []
    for campaign_id, (failed, total) in sorted(outcomes.totals().items()):
        if total < MIN_OUTCOMES or failed / total <= share_limit or (only is not None and campaign_id not in only):
            continue
        alerts.append(
            Alert(
                LEASE_FAILURES,
                "warning",
                campaign_id,
                f"campaign {campaign_id}: {failed} of the last {total} leases expired or were rejected "
                f"in {WINDOW_S / 60:.0f} minutes (limit {share_limit:.0%})",
                "read the reasons in crowdtrain_lease_outcomes_total (the dashboard's lease outcomes): "
                "'deadline passed' means agents die or are too slow for their leases; 'stale version' means "
                "aggregators apply steps slowly; 'bad receipt' points at an aggregator that restarted; "
                "many rejections from one volunteer are for the review queue",
            )
        )
    return alerts


def _failing_tasks() -> list[Alert]:
    now = hot_state().clock()
    alerts = []
    for name, (count, at) in sorted(task_failures.failures().items()):
        if now - at > TASK_FAILURE_WINDOW_S:
            continue
        alerts.append(
            Alert(
                TASK_FAILING,
                "warning",
                None,
                f"Celery task {name} failed {now - at:.0f} s ago ({count} failures counted in all)",
                "read the Celery worker's log for the task's traceback; check that the worker and beat "
                "are running (docker compose ps worker beat) and reach PostgreSQL, Redis and the storage",
            )
        )
    return alerts


def evaluate(now: datetime | None = None) -> list[Alert]:
    """Every alert firing now, campaign alerts in campaign order, then the site's own.

    Args:
        now: the time to judge "stalled" against (default: now).
    """
    return _campaign_alerts(_running_campaigns(), now or timezone.now(), every=True) + _failing_tasks()


def evaluate_campaign(campaign_id: int, now: datetime | None = None) -> list[Alert]:
    """The alerts of one campaign, as ``evaluate`` judges them: what its organizer's page shows.

    Empty unless the campaign is running (a paused or finished one is not expected to step).
    """
    running = _running_campaigns(campaign_id)
    return _campaign_alerts(running, now or timezone.now(), every=False) if running else []


def _campaign_alerts(running: list[_Running], now: datetime, *, every: bool) -> list[Alert]:
    silent, slices = _silent_aggregators(running)
    silent_ids = {a.campaign_id for a in silent if a.campaign_id is not None}
    waiting = _waiting_for_aggregators(running, slices, silent_ids)
    blocked = _blocked(running)
    behind = _checkpoints_behind(running)
    held = [a for a in behind if a.severity == "critical"]
    excused = silent_ids | {a.campaign_id for a in waiting + blocked + held if a.campaign_id is not None}
    failures = _lease_failures(None if every else running)
    alerts = silent + waiting + blocked + behind + _stalled(running, now, excused) + failures
    alerts.sort(key=lambda a: (a.campaign_id or 0, CODES.index(a.code)))
    return alerts


def status_of(alerts: list[Alert]) -> Literal["ok", "warning", "degraded"]:
    """``degraded`` with any critical alert, ``warning`` with warnings only, else ``ok``."""
    if any(a.severity == "critical" for a in alerts):
        return "degraded"
    return "warning" if alerts else "ok"


def summary(alerts: list[Alert]) -> str:
    """The most urgent of the alerts in a few words ("aggregator down", "no volunteers"), or "ok": for badges,
    which must tell a dead aggregator from a campaign nobody has joined yet."""
    if not alerts:
        return "ok"
    worst = min(alerts, key=lambda a: (a.severity != "critical", CODES.index(a.code)))
    return SUMMARIES[worst.code]
