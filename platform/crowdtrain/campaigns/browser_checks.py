"""A campaign's side of browser compute: asking for its model's graphs to be checked, and the verdict it has.

The graphs belong to ``crowdtrain.browser`` (a layer below: it knows models,
not campaigns); this module says which model, config and microbatch a
campaign trains, and which campaigns no tab can work on whatever the graph.
"""

from __future__ import annotations

import logging

from crowdtrain.browser.checking import Verdict, request_check, verdict_for
from crowdtrain.browser.models import BrowserGraph

from .models import Campaign

logger = logging.getLogger(__name__)


LOCAL_MODE_REASON = (
    "it trains in local mode (DiLoCo): a lease takes inner optimizer steps, which a browser tab, "
    "computing one gradient with the exported graph, cannot"
)


def check_for_browsers(campaign: Campaign, *, again: bool = False) -> BrowserGraph | None:
    """Queue the check of the campaign's model for browser tabs (after the caller's commit); never raises.

    A failure here must not stop a campaign from starting or its form from
    saving: it is logged, and ``manage.py check_browser_graphs`` tries again.
    """
    if campaign.training_mode == Campaign.TrainingMode.LOCAL:
        return None
    try:
        return request_check(campaign.architecture, campaign.model_config, campaign.microbatch_size, again=again)
    except Exception:
        logger.exception("campaign %s: the check of its model for browsers could not be queued", campaign.pk)
        return None


def browser_verdict(campaign: Campaign) -> Verdict:
    """Whether tabs are offered this campaign's work, with the reason in words."""
    if campaign.training_mode == Campaign.TrainingMode.LOCAL:
        return Verdict(BrowserGraph.Status.REFUSED, LOCAL_MODE_REASON)
    return verdict_for(campaign.architecture, campaign.model_config, campaign.microbatch_size)
