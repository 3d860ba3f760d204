"""Judging checks in the Celery worker, off the sockets' processes (BOINC runs its validator as a daemon apart)."""

from __future__ import annotations

from celery import shared_task

from . import checks


@shared_task
def judge_checks(check_ids: list[int]) -> None:
    """Decide checks whose copies' answers were just written, or call third volunteers (``checks.judge``).

    A list, as a site process writes copies' answers in batches; each judgement is idempotent.
    """
    for check_id in check_ids:
        checks.judge(int(check_id))


@shared_task
def judge_check(check_id: int) -> None:
    """One check: the task sites before 2.9 queued, still in the broker when they were replaced."""
    checks.judge(check_id)
