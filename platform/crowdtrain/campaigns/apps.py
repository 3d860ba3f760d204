from __future__ import annotations

from django.apps import AppConfig


class CampaignsConfig(AppConfig):
    name = "crowdtrain.campaigns"
    label = "campaigns"
