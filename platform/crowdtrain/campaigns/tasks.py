"""Celery tasks of campaigns: the slow work the organizer's pages wait for."""

from __future__ import annotations

import logging

from celery import shared_task

from . import validation

logger = logging.getLogger(__name__)


@shared_task
def compute_validation_loss(campaign_id: int, version: int) -> float | None:
    """Export the parameters of ``version`` and store their held-out loss; idempotent, skips a vanished campaign.

    No retries: a version the aggregators no longer hold cannot come back,
    and the next ``validate_every`` step brings a newer one.
    """
    result = validation.compute(campaign_id, version)
    return result.loss if result is not None else None
