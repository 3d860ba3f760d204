"""Periodic scheduler work for Celery beat; each site process also sweeps on its own (gateway.housekeeping)."""

from __future__ import annotations

from asgiref.sync import async_to_sync
from celery import shared_task

from . import seam
from .endings import expire_all_overdue


@shared_task
def expire_leases() -> int:
    """Expire leases of gone agents past their deadline in every running campaign; idempotent."""
    send_commits, wake = seam.publisher().send_commits, seam.publisher().wake
    expired, commits, woken = expire_all_overdue()
    if commits:  # a step a crashed process left full: the aggregators still need to hear of it
        async_to_sync(send_commits)(commits)
    for campaign_id, channels in woken.items():  # requests waiting on a site process: one may take a backup
        async_to_sync(wake)(campaign_id, channels)
    return expired
