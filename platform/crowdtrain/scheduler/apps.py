from __future__ import annotations

from django.apps import AppConfig


class SchedulerConfig(AppConfig):
    name = "crowdtrain.scheduler"
    label = "scheduler"
