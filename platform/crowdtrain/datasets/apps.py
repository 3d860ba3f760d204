from __future__ import annotations

from django.apps import AppConfig


class DatasetsConfig(AppConfig):
    name = "crowdtrain.datasets"
    label = "datasets"
