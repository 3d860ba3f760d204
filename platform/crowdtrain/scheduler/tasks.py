"""Periodic scheduler work for Celery beat; the lease path also sweeps on every request."""

from __future__ import annotations

from celery import shared_task

from .leasing import expire_all_overdue


@shared_task
def expire_leases() -> int:
    """Expire overdue leases of every running campaign; idempotent."""
    return expire_all_overdue()
