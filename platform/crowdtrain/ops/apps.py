from __future__ import annotations

from django.apps import AppConfig


class OpsConfig(AppConfig):
    name = "crowdtrain.ops"
    label = "ops"
    verbose_name = "Operations"

    def ready(self) -> None:
        from prometheus_client import REGISTRY

        from . import collectors, task_failures

        task_failures.connect()
        collectors.register(REGISTRY)
