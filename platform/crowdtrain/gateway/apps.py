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
        from crowdtrain.campaigns.signals import campaign_running

        campaign_running.connect(outbox.campaign_running, dispatch_uid="gateway.campaign_running")
        from crowdtrain.devices.signals import device_controls_changed, device_revoked

        device_revoked.connect(outbox.device_revoked, dispatch_uid="gateway.device_revoked")
        device_controls_changed.connect(outbox.device_controls_changed, dispatch_uid="gateway.device_controls")
