from __future__ import annotations

from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "crowdtrain.accounts"
    label = "accounts"

    def ready(self) -> None:
        from django.conf import settings
        from django.db.models.signals import post_save

        from crowdtrain import checks  # noqa: F401  (registers the production checks)

        from .superusers import verify_superuser_email

        post_save.connect(
            verify_superuser_email, sender=settings.AUTH_USER_MODEL, dispatch_uid="verify-superuser-email"
        )
