from __future__ import annotations

from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "crowdtrain.accounts"
    label = "accounts"

    def ready(self) -> None:
        from crowdtrain import checks  # noqa: F401  (registers the production checks)
