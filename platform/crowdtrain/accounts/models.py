from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from .tokens import hash_token, new_token


class DeviceQuerySet(models.QuerySet["Device"]):
    def active(self) -> DeviceQuerySet:
        return self.filter(revoked_at__isnull=True)


class Device(models.Model):
    """One agent installation of one volunteer, with its own API token."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="devices")
    name = models.CharField(max_length=100)
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    hardware = models.JSONField(default=dict, blank=True)
    samples_per_s = models.FloatField(default=0.0)
    samples_accepted = models.BigIntegerField(default=0)

    objects = DeviceQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.owner})"

    @classmethod
    def issue(cls, owner: models.Model, name: str) -> tuple[Device, str]:
        """Create a device and return it with its token, which is never stored in clear."""
        token = new_token("ctd")
        return cls.objects.create(owner=owner, name=name, token_hash=hash_token(token)), token

    @classmethod
    def authenticate(cls, token: str | None) -> Device | None:
        """The device a token belongs to (revoked ones included, so callers can say why)."""
        if not token:
            return None
        return cls.objects.select_related("owner").filter(token_hash=hash_token(token)).first()

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None
