"""Judging checks in the Celery worker, off the sockets' processes (BOINC runs its validator as a daemon apart)."""

from __future__ import annotations

from celery import shared_task

from . import checks


@shared_task
def judge_check(check_id: int) -> None:
    """Decide a check whose copy just reported, or send it to the referee (``checks.judge``); idempotent."""
    checks.judge(check_id)


@shared_task
def keep_version(campaign_id: int, version: int) -> None:
    """Keep a version a check just opened on, for the referee (``referee.store``); idempotent."""
    from . import referee

    referee.store(campaign_id, version)


@shared_task
def referee_check(check_id: int) -> None:
    """Recompute a disputed lease and decide its check (``referee.rule``); idempotent."""
    from . import referee

    referee.rule(check_id)
