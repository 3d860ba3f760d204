"""Leases that end without a report: given back, left by a disconnected agent, or past their deadline.

Their samples go back into their step to be redone; requests waiting for
room are woken for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from django.conf import settings

from crowdtrain.campaigns.models import Campaign, Step
from crowdtrain.datasets.models import shard_table

from . import committer, seam
from .commits import Commit, commit_full_steps
from .configs import campaign_config, running_campaigns
from .hotrecords import full_step
from .hotstate import hot_state
from .parking import pass_on_wake
from .scripts import lease_place, record_retired, run


@dataclass(frozen=True)
class Released:
    """Leases given back, and per campaign the waiting requests their samples can serve now."""

    count: int = 0
    woken: dict[int, list[str]] = field(default_factory=dict)


def release_leases(device_id: int, lease_ids: Sequence[int], reason: str = "released by the agent") -> Released:
    """Give unfinished leases back (the agent stops, or its socket closed for good); their samples are redone.

    Requests waiting for room are woken, one per lease released (the
    samples of one lease serve one request): otherwise they would sleep until
    the next commit, which waits for exactly these samples.
    """
    count = 0
    woken: dict[int, list[str]] = {}
    for lease_id in lease_ids:
        config, copy = lease_place(lease_id)
        if config is None:
            continue
        if copy:
            seam.verification().copy_released(lease_id, reason, device_id=device_id, marker=copy)
            continue
        answer = run(config, "release", {"id": lease_id, "device": device_id, "reason": reason, "state": "released"})
        retired = answer.get("retired") or []
        record_retired(retired, config.id)
        if retired:
            count += 1
            woken.setdefault(config.id, []).extend(pass_on_wake(config.id, any_step=True))
    return Released(count, woken)


def release_lease(device_id: int, lease_id: int, reason: str = "released by the agent") -> bool:
    """Give one unfinished lease back; whether it was still out (``release_leases`` also says whom to wake)."""
    return release_leases(device_id, [lease_id], reason).count > 0


def release_if_gone(device_id: int, lease_ids: list[int], since: float) -> Released:
    """Release a disconnected agent's leases unless it came back (seen after ``since``).

    Its socket closed, so waiting for the lease's deadline would only hold the
    step back; the short grace lets an agent whose connection merely dropped
    reconnect and report.
    """
    seen = hot_state().last_seen([device_id]).get(device_id, 0.0)
    if seen > since:
        return Released()
    return release_leases(device_id, lease_ids, "agent disconnected")


class Swept(NamedTuple):
    """What one sweep of a campaign did: leases expired, steps it closed, and whether a backup is due."""

    expired: int
    commits: list[Commit]
    backup_due: bool = False


def sweep_campaign(campaign_id: int) -> Swept:
    """Expire leases of gone agents past their deadline, and finish a commit a crashed process left open."""
    config = campaign_config(campaign_id)
    if config is None:
        return Swept(0, [])
    args = {"limit": 1000, "gone_s": settings.CROWDTRAIN_GONE_AFTER_S, "alive_since": committer.alive_since(),
            "backup_min_s": settings.CROWDTRAIN_BACKUP_MIN_S}  # fmt: skip
    answer = run(config, "sweep", args)
    expired = answer.get("expired") or []
    record_retired(expired, config.id)
    commits = commit_full_steps(config, full_step(answer["commit"])) if answer.get("commit") else []
    return Swept(len(expired), commits, bool(answer.get("backup_due")))


def expire_overdue(campaign: Campaign) -> int:
    """Expire the campaign's leases past their deadline whose agents are gone; returns how many."""
    return sweep_campaign(campaign.pk).expired


def expire_all_overdue() -> tuple[int, list[Commit], dict[int, list[str]]]:
    """Periodic sweep of every running campaign (its cost grows with campaigns, not volunteers).

    Returns:
        (leases expired, steps closed, {campaign: waiting requests woken to take a backup that is due}).
    """
    count, commits, woken = 0, [], {}
    for campaign_id in running_campaigns():
        swept = sweep_campaign(campaign_id)
        count += swept.expired
        commits += swept.commits
        if swept.backup_due and (channels := pass_on_wake(campaign_id, any_step=True)):
            woken[campaign_id] = channels
    return count, commits, woken


def step_ranges(step: Step) -> list[tuple[str, int, int]]:
    """The (shard sha256, start, count) ranges that made a committed step, in lease-id order."""
    shards = shard_table(step.campaign.dataset).sha256s
    return [(shards[s], start, count) for lease in step.leases.order_by("id") for _, s, start, count in lease.ranges]
