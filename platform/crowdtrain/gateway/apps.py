from __future__ import annotations

from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "crowdtrain.gateway"
    label = "gateway"

    def ready(self) -> None:
        # The scheduler's commits reach the aggregators, and its wake-ups the waiting requests, through its seam.
        from crowdtrain.scheduler import seam

        from . import outbox

        seam.install(publisher=outbox)
