from __future__ import annotations

from django.apps import AppConfig


class CreditConfig(AppConfig):
    name = "crowdtrain.credit"
    label = "credit"
    verbose_name = "Credit"
