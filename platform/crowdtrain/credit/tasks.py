"""Scheduled upkeep of the leaderboards, and the daily stats export (Celery beat)."""

from __future__ import annotations

from celery import shared_task

from . import boards, export


@shared_task
def age_leaderboards() -> None:
    """Move the 24-hour and 7-day windows on by the hours that passed (readers do it too; this keeps them warm)."""
    boards.ensure_built()
    boards.age_out()


@shared_task
def rebuild_leaderboards() -> None:
    """Recompute every board from the ledger: repairs an update that was lost (Redis down) or raced a rebuild."""
    boards.rebuild()


@shared_task
def export_stats() -> None:
    """Write the daily stats document for third-party stats sites (``/stats/stats.json``); each run replaces it."""
    export.export_stats()
