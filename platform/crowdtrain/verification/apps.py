from __future__ import annotations

from django.apps import AppConfig


class VerificationConfig(AppConfig):
    name = "crowdtrain.verification"
    label = "verification"
    verbose_name = "Verification"
