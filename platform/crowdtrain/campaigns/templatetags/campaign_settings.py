"""Template tags for a campaign's settings, read from the settings table and the optimizer registry."""

from __future__ import annotations

from typing import Any

from django import template

from crowdtrain.campaigns.models import Campaign
from crowdtrain_agent.optimizers import OPTIMIZERS, SCHEDULE, stored_value

from ..settings_table import Group, Setting, display, summary

register = template.Library()


@register.simple_tag
def campaign_settings(campaign: Campaign) -> list[tuple[Group, list[tuple[Setting, str]]]]:
    """``{% campaign_settings campaign as groups %}``: each group's settings and their values in words."""
    return summary(campaign)


@register.simple_tag
def optimizer_summary(campaign: Campaign) -> dict[str, Any]:
    """``{% optimizer_summary campaign as opt %}``: the optimizer's label and the values it reads, labelled."""
    stored = dict(campaign.optimizer or {})
    entry = OPTIMIZERS.get(stored.get("name", ""))
    if entry is None:  # an optimizer this site no longer knows: show what is stored
        return {"label": str(stored.get("name")), "values": [(k, display(v)) for k, v in stored.items()]}
    fields = {**entry.hyperparameters, **SCHEDULE}
    values = [
        (spec.label or name, display(stored_value(stored, name, spec.default)))
        for name, spec in fields.items()
        if name != "total_steps" or stored.get("total_steps") is not None
    ]
    return {"label": entry.label, "values": values}
