from __future__ import annotations

from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "crowdtrain.gateway"
    label = "gateway"
