"""Judging checks in the Celery worker, off the sockets' processes (BOINC runs its validator as a daemon apart)."""

from __future__ import annotations

from celery import shared_task

from . import checks


@shared_task
def judge_check(check_id: int) -> None:
    """Decide a check whose copy just reported, or call a third volunteer (``checks.judge``); idempotent."""
    checks.judge(check_id)
