from __future__ import annotations

from django.apps import AppConfig


class BrowserConfig(AppConfig):
    name = "crowdtrain.browser"
    label = "browser"
    verbose_name = "browser compute"
