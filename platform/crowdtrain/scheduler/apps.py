from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_save


class SchedulerConfig(AppConfig):
    name = "crowdtrain.scheduler"
    label = "scheduler"

    def ready(self) -> None:
        from crowdtrain.campaigns.models import Campaign
        from crowdtrain.campaigns.signals import campaign_changed

        post_save.connect(_campaign_saved, sender=Campaign, dispatch_uid="scheduler.campaign_saved")
        campaign_changed.connect(_campaign_changed, dispatch_uid="scheduler.campaign_changed")


# Columns the lease path reads besides the settings the table marks ``lease``; saving others (the version,
# every step) changes nothing for it.
_LEASE_COLUMNS = frozenset({"state", "visibility"})


def _campaign_changed(*, campaign_id: int, **_: Any) -> None:
    from .configs import publish_state

    publish_state(campaign_id)


def _campaign_saved(
    sender: type, instance: Any, created: bool, raw: bool = False, update_fields: Any = None, **kwargs: Any
) -> None:
    """Every site process re-reads a campaign whose row changed (its state, above all) before its next lease.

    At once, not on commit: the read sees this transaction's own change, and a lease
    must not be issued from a campaign paused a moment ago. A transaction that
    then rolls back leaves a generation bumped for nothing, which is harmless.
    """
    if raw or created:
        return
    from crowdtrain.campaigns.settings_table import lease_settings

    if update_fields is not None and not (_LEASE_COLUMNS | lease_settings()) & set(update_fields):
        return
    from .configs import publish_state

    publish_state(instance.pk)
