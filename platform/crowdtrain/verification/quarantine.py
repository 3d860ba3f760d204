"""Quarantine: a volunteer whose results keep disagreeing with others' stops counting until an admin decides.

Quarantine does four things at once: the volunteer's work that no step has
committed yet is left out (its samples go back to the queue for others), new
leases are refused with a message that says why and where to appeal, their
credit is taken back, and they appear in the admins' review queue, where an
admin clears them (credit given back, work accepted again) or bans them
(devices revoked).
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.utils import timezone

from crowdtrain.accounts.models import Device
from crowdtrain.credit import ledger
from crowdtrain.scheduler.configs import campaign_config, running_campaigns
from crowdtrain.scheduler.hotstate import HotStateMissing, hot_state

from . import standing
from .models import Standing

logger = logging.getLogger(__name__)


def consider(volunteer_id: int) -> bool:
    """Quarantine a volunteer whose failed checks or lost rulings crossed the line; whether this call did.

    Lost rulings are counted among rulings only: passes that two colluding accounts give each other's
    work do not thin them out.
    """
    row = Standing.objects.filter(volunteer_id=volunteer_id).first()
    if row is None or row.state != Standing.State.GOOD:
        return False
    # A refused upload is a result that failed without a check: it counts as a failed one.
    failed, total = row.checks_failed + row.uploads_refused, row.checks + row.uploads_refused
    lost, rulings = row.rulings_lost, row.rulings_won + row.rulings_lost
    by_checks = failed >= standing.QUARANTINE_FAILURES and failed >= standing.QUARANTINE_SHARE * total
    by_rulings = lost >= standing.QUARANTINE_FAILURES and lost >= standing.QUARANTINE_SHARE * rulings
    if not (by_checks or by_rulings):
        return False
    reasons = []
    if lost:
        reasons.append(
            f"{lost} of {rulings} of its results the site recomputed disagreed with the site's own result for "
            "the same samples"
        )
    if row.checks_failed > lost:
        reasons.append(
            f"{row.checks_failed - lost} of {row.checks} of its results disagreed with those of other volunteers "
            "who computed the same samples"
        )
    if row.uploads_refused:
        reasons.append(
            f"the aggregators refused {row.uploads_refused} of its uploads for what they held (values that are "
            "not finite, or a malformed payload)"
        )
    return quarantine(volunteer_id, "; ".join(reasons))


def quarantine(volunteer_id: int, reason: str) -> bool:
    """Put a volunteer in quarantine (see the module docstring); whether they were not in it already."""
    outcome = _set_aside(volunteer_id, Standing.State.QUARANTINED, reason, None, "volunteer quarantined")
    if outcome is None:
        return False
    taken, dropped = outcome
    logger.warning(
        "volunteer %s quarantined (%s): %s leases left out of steps, credit of %s leases taken back",
        volunteer_id,
        reason,
        dropped,
        taken,
    )
    return True


def _set_aside(volunteer_id: int, state: str, reason: str, admin_id: int | None, why: str) -> tuple[int, int] | None:
    """Quarantine or ban: the new state, credit taken back, pending work dropped.

    Returns:
        (leases whose credit was taken, leases dropped), or None if the volunteer was in that state
        already (quarantine applies to volunteers in good standing only).
    """
    with transaction.atomic():
        row, _ = Standing.objects.select_for_update().get_or_create(volunteer_id=volunteer_id)
        if row.state == state or (state == Standing.State.QUARANTINED and row.state != Standing.State.GOOD):
            return None
        row.state, row.reason, row.changed_at, row.reviewed_by_id = state, reason[:500], timezone.now(), admin_id
        row.save(update_fields=["state", "reason", "changed_at", "reviewed_by"])
        taken = ledger.quarantine(volunteer_id, why)
    standing.forget(volunteer_id)
    return taken, drop_pending_work(volunteer_id, why)


def drop_pending_work(volunteer_id: int, reason: str) -> int:
    """Leave the volunteer's uncommitted leases out of every running campaign's steps; returns how many."""
    from crowdtrain.scheduler.rebuild import load_campaign
    from crowdtrain.scheduler.scripts import record_retired

    devices = list(Device.objects.filter(owner_id=volunteer_id).values_list("pk", flat=True))
    if not devices:
        return 0
    count = 0
    for campaign_id in running_campaigns():
        config = campaign_config(campaign_id)
        if config is None:
            continue
        args: dict[str, Any] = {"devices": devices, "reason": reason}
        try:
            answer = hot_state().run("drop", config.hot_key, args)
        except HotStateMissing:
            load_campaign(config.id)
            answer = hot_state().run("drop", config.hot_key, args)
        retired = answer.get("retired") or []
        record_retired(retired)
        count += len(retired)
    return count


def clear(volunteer_id: int, admin_id: int | None) -> bool:
    """An admin found the volunteer honest: they work again and get their credit back. Whether anything changed."""
    with transaction.atomic():
        row = Standing.objects.select_for_update().filter(volunteer_id=volunteer_id).first()
        if row is None or row.state != Standing.State.QUARANTINED:
            return False
        # The failures were reviewed: counting starts afresh (the answers keep the history).
        row.state, row.checks_failed, row.uploads_refused, row.streak = Standing.State.GOOD, 0, 0, 0
        row.rulings_lost = 0
        row.reason, row.changed_at, row.reviewed_by_id = "", timezone.now(), admin_id
        row.save()
        restored = ledger.restore(volunteer_id, "cleared by an admin")
    standing.forget(volunteer_id)
    from .checks import release_credit

    release_credit()
    logger.info("volunteer %s cleared by admin %s; credit of %s leases given back", volunteer_id, admin_id, restored)
    return True


def ban(volunteer_id: int, admin_id: int | None, reason: str = "banned after review") -> bool:
    """An admin found the volunteer hostile: their devices are revoked for good and their credit stays taken back."""
    from crowdtrain.devices.actions import revoke

    if _set_aside(volunteer_id, Standing.State.BANNED, reason, admin_id, "volunteer banned") is None:
        return False
    for device in Device.objects.filter(owner_id=volunteer_id, revoked_at__isnull=True):
        revoke(device, "the account was banned")
    logger.warning("volunteer %s banned by admin %s: %s", volunteer_id, admin_id, reason)
    return True
