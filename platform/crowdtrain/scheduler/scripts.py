"""Running a campaign's scripts on its hot state, and the record of what they retired.

Every path of the scheduler (a lease, a report, a release, a sweep, a waiting request) is one script
run by Redis on the campaign's hot state; this is how each runs one and records the leases it ended.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from crowdtrain.lib import metrics

from . import seam
from .configs import CampaignConfig, campaign_config, forget
from .hotstate import HotStateMissing, hot_state
from .lease_rows import moment
from .models import Lease
from .rebuild import load_campaign
from .records import Finished, writer

logger = logging.getLogger(__name__)


def run(config: CampaignConfig, script: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run a script, loading the campaign's hot state from the record first if Redis has none."""
    try:
        return hot_state().run(script, config.hot_key, args)
    except HotStateMissing:
        load_campaign(config.id)
        # Read the campaign again: a copy cached before its row was replaced names another hot state.
        forget(config.id)
        fresh = campaign_config(config.id) or config
        return hot_state().run(script, fresh.hot_key, args)


def record_retired(retired: list[list[Any]], campaign_id: int | None = None) -> None:
    """Queue the record of leases a script ended (``[id, state, reason]`` triples), and count them.

    ``campaign_id``: the campaign they belong to, for the metrics and the log (None: counted without one).
    """
    if not retired:
        return
    when = moment(hot_state().clock())
    for lease_id, state, reason in retired:
        writer().lease_finished(Finished(int(lease_id), str(state), str(reason), when))
        metrics.lease_ended(campaign_id, str(state), str(reason))
        logger.info(
            "lease %s %s: %s", lease_id, state, reason, extra={"campaign_id": campaign_id, "lease_id": int(lease_id)}
        )


def lease_place(lease_id: int) -> tuple[CampaignConfig | None, str]:
    """The campaign of a lease, and its copy marker if it is a verification copy ("" if not)."""
    state = hot_state()
    campaign_id: str | int | None = cast("str | None", state.client.hget(state.lease_campaigns_key, str(lease_id)))
    if campaign_id is None:
        found = Lease.objects.filter(pk=lease_id).values_list("campaign_id", flat=True).first()
        if found is None:
            return None, ""
        campaign_id = found
    text = str(campaign_id)
    return campaign_config(int(text.split(":")[0])), text if seam.verification().is_copy_marker(text) else ""
