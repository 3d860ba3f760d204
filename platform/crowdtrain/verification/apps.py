from __future__ import annotations

from django.apps import AppConfig


class VerificationConfig(AppConfig):
    name = "crowdtrain.verification"
    label = "verification"
    verbose_name = "Verification"

    def ready(self) -> None:
        # The lease path asks for copies and standing through the scheduler's seam: it never imports us.
        from crowdtrain.scheduler import seam

        from . import checks, standing

        seam.install(verification=checks, standing=standing)
