"""Every periodic job of the site and how often it runs, in one place (issue 35).

Three clocks drive them:

- **Celery beat** (``BEAT_JOBS``) runs the jobs one process of the whole
  deployment must do; ``settings.CELERY_BEAT_SCHEDULE`` is built from the list.
- **The housekeeping round** (``ROUND_JOBS``) runs on the event loop of every
  site process (``gateway/housekeeping.py``), because its jobs are about the
  sockets that process holds, or must go on where no beat runs (the embedded
  default has none).
- **Loops of their own** (``OWN_LOOPS``) belong to one component, which keeps
  their period beside the code that depends on it; they are listed here so
  none is missed.

This module imports no app: the settings read it before any app is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Job:
    """One periodic job: ``call`` is what runs (a beat job's Celery task name, else a dotted path), ``every`` how
    often, in words."""

    name: str
    call: str
    every: str
    every_s: float | None = None  # the fixed period, where there is one


BEAT_JOBS = [
    # Each site process's round expires overdue leases too; this one also runs where no site process is up.
    Job("expire-leases", "crowdtrain.scheduler.tasks.expire_leases", "every 5 s", 5.0),
    Job("discard-stale-uploads", "crowdtrain.campaigns.tasks.discard_stale_uploads", "hourly", 3600.0),
    Job("age-leaderboards", "crowdtrain.credit.tasks.age_leaderboards", "every 5 minutes", 300.0),
    Job("rebuild-leaderboards", "crowdtrain.credit.tasks.rebuild_leaderboards", "daily", 86400.0),
    Job("export-stats", "crowdtrain.credit.tasks.export_stats", "daily", 86400.0),
]


def beat_schedule() -> dict[str, dict[str, object]]:
    """``CELERY_BEAT_SCHEDULE``: each of ``BEAT_JOBS`` under its name."""
    return {job.name: {"task": job.call, "schedule": job.every_s} for job in BEAT_JOBS}


def round_interval_s(gone_after_s: float) -> float:
    """How often the housekeeping round runs, given ``CROWDTRAIN_GONE_AFTER_S``.

    Well inside the gone-after window: a connected device must never look gone between two rounds.
    """
    return max(0.2, min(5.0, gone_after_s / 4))


# The round's slower jobs run when this much has passed since they last ran; consumers also read it to know
# how stale "last seen" in the database may be.
LAST_SEEN_DB_EVERY_S = 60.0

ROUND_JOBS = [
    Job("publish-presence", "crowdtrain.scheduler.hotstate.Presence.publish", "every round"),
    Job("expire-overdue-leases", "crowdtrain.scheduler.endings.expire_all_overdue", "every round"),
    Job(
        "reload-volunteer-records",
        "crowdtrain.verification.standing.refresh_records",
        "every half of verification.standing.RECORD_REFRESH_AT_S (15 s)",
    ),
    Job("stamp-last-seen", "crowdtrain.gateway.housekeeping._stamp_last_seen", "every minute", LAST_SEEN_DB_EVERY_S),
    Job("verification-upkeep", "crowdtrain.verification.checks.upkeep", "every minute", LAST_SEEN_DB_EVERY_S),
    Job(
        "repair-step-counters",
        "crowdtrain.scheduler.invariants.repair_step_counters",
        "every minute",
        LAST_SEEN_DB_EVERY_S,
    ),
    Job("dashboard-minute", "crowdtrain.ops.history.record_minute", "when the clock's minute changes"),
    Job(
        "channel-layer-groups",
        "crowdtrain.gateway.groups.Memberships.refresh",
        "every round; a socket's groups are added again hourly (gateway.groups.REFRESH_S) or when Redis lost them",
    ),
]

OWN_LOOPS = [
    Job(
        "write-lease-records",
        "crowdtrain.scheduler.records.RecordWriter",
        "every scheduler.records.FLUSH_INTERVAL_S (0.25 s), or sooner when a batch fills",
    ),
    Job(
        "committer-alive",
        "crowdtrain.scheduler.committer.Committer",
        "every scheduler.committer.RENEW_S (1 s) while manage.py run_committer runs",
    ),
    Job(
        "dashboard-push",
        "crowdtrain.gateway.dashboard.DashboardConsumer",
        "every CROWDTRAIN_DASHBOARD_PUSH_S to each open dashboard page",
    ),
]
