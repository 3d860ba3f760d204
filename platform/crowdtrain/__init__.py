"""Crowdtrain site: identity, campaigns, the scheduler and the gateway for agents and aggregators."""

from __future__ import annotations

# Importing the Celery app here makes @shared_task bind to it, so eager mode
# and the embedded broker apply (../shared/STACK.md).
from .celery import app as celery_app

__all__ = ["celery_app"]
