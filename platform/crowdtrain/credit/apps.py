from __future__ import annotations

from django.apps import AppConfig


class CreditConfig(AppConfig):
    name = "crowdtrain.credit"
    label = "credit"
    verbose_name = "Credit"

    def ready(self) -> None:
        # Committed steps are granted, rolled-back ones taken back, through the scheduler's seam.
        from crowdtrain.scheduler import seam

        from . import ledger

        seam.install(credit=ledger)
