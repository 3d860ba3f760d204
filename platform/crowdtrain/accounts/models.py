from __future__ import annotations

import re
import secrets
import unicodedata
from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models.functions import Lower
from django.db.models.signals import post_save
from django.dispatch import receiver
from django.urls import reverse
from django.utils import timezone
from django.utils.text import slugify

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
    # The volunteer's controls set on My devices (``devices.clean_controls``), sent with each welcome (2.8).
    controls = models.JSONField(default=dict, blank=True)
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
        # A deactivated account's devices stop with it: an admin banning a volunteer bans their agents.
        return cls.objects.select_related("owner").filter(token_hash=hash_token(token), owner__is_active=True).first()

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None


class DeviceAuthorization(models.Model):
    """One device-code login (RFC 8628): an agent asks, a volunteer approves in the browser, the agent gets a token.

    The agent holds the secret ``device_code`` (stored only hashed); the
    volunteer types the short ``user_code`` on the site. Approval names the
    user the new Device will belong to; the token is issued once, to the first
    poll that finds the approval, and the row is then spent.
    """

    device_code_hash = models.CharField(max_length=64, unique=True, editable=False)
    # Stored normalized: upper case, no dash; unique among live codes, not forever.
    user_code = models.CharField(max_length=16, db_index=True)
    requested_name = models.CharField(max_length=100)
    hardware = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    interval = models.PositiveIntegerField()  # seconds between polls; grows by 5 on each slow_down
    last_polled_at = models.DateTimeField(null=True, blank=True)
    approved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="device_approvals"
    )
    approved_name = models.CharField(max_length=100, blank=True)
    denied_at = models.DateTimeField(null=True, blank=True)
    consumed_at = models.DateTimeField(null=True, blank=True)
    device = models.ForeignKey(Device, null=True, blank=True, on_delete=models.SET_NULL, related_name="authorizations")

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.user_code} ({self.requested_name})"

    def is_expired(self, now: datetime | None = None) -> bool:
        return (now or timezone.now()) >= self.expires_at

    @property
    def is_decided(self) -> bool:
        """Approved or denied: the user code cannot be used again."""
        return self.approved_by_id is not None or self.denied_at is not None


# ------------------------------------------------------ volunteers and teams

ANONYMOUS_NAME = "Anonymous volunteer"
# Letters and digits of any script, spaces and a little punctuation: enough for
# real names and handles, too little to fake markup or another person's badge.
_PUBLIC_NAME = re.compile(r"^[\w][\w .'\-]*$")


def validate_public_name(value: str) -> None:
    """Names shown on public pages (display names, team names)."""
    if value != value.strip():
        raise ValidationError("Remove the spaces at the start and end.")
    if not _PUBLIC_NAME.match(value):
        raise ValidationError(
            f"{value!r} has characters we cannot show; use letters, digits, spaces, dots, dashes or apostrophes."
        )
    # Compared as people read them: compatibility forms folded (NFKC), case and punctuation ignored.
    # Look-alike letters of other scripts (Cyrillic "А") are not caught; names are not identities.
    seen_as = re.sub(r"[\W_]+", " ", unicodedata.normalize("NFKC", value).casefold()).strip()
    if seen_as == ANONYMOUS_NAME.casefold():
        raise ValidationError(f"{ANONYMOUS_NAME!r} is reserved for volunteers who hide their name; choose another.")
    if re.fullmatch(r"volunteer \d+", seen_as):
        raise ValidationError("Names like 'Volunteer 12' are how volunteers without a name are shown; choose another.")


def new_invite_code() -> str:
    # 192 random bits: unguessable, so a bare indexed lookup is safe.
    return secrets.token_urlsafe(24)


class Team(models.Model):
    """Volunteers who pool their credit. Anyone holding the current invite link can join.

    The invite code is kept in clear, not hashed like device tokens, because
    every member is shown the link again on the team page. It is random and
    unguessable, and the team's creator rotates it, which kills the old link.
    """

    # Slugs that would shadow the fixed team pages (/teams/new, /teams/join/...).
    RESERVED_SLUGS = frozenset({"new", "join"})

    name = models.CharField(max_length=60, validators=[validate_public_name])
    slug = models.SlugField(max_length=70, unique=True, editable=False)
    description = models.TextField(max_length=1000, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="teams_created"
    )
    created_at = models.DateTimeField(default=timezone.now)
    invite_code = models.CharField(max_length=64, unique=True, editable=False, default=new_invite_code)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(
                Lower("name"),
                name="accounts_team_name_unique_ci",
                violation_error_message="A team with this name already exists; choose another name.",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        return reverse("team", kwargs={"slug": self.slug})

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.slug:
            self.slug = self._free_slug()
        super().save(*args, **kwargs)

    def _free_slug(self) -> str:
        base = slugify(self.name)[:60] or "team"
        slug, n = base, 1
        while slug in self.RESERVED_SLUGS or Team.objects.filter(slug=slug).exists():
            n += 1
            slug = f"{base}-{n}"
        return slug

    def rotate_invite_code(self) -> None:
        self.invite_code = new_invite_code()
        self.save(update_fields=["invite_code"])

    def is_member(self, user: Any) -> bool:
        return bool(user.is_authenticated) and self.members.filter(user=user).exists()


class Profile(models.Model):
    """What a volunteer shows of themselves on public pages, and their team."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="profile")
    display_name = models.CharField(max_length=40, blank=True, validators=[validate_public_name])
    anonymous = models.BooleanField(
        default=False, help_text=f"Appear as {ANONYMOUS_NAME!r} on leaderboards and team pages."
    )
    # One team per volunteer; a team that is deleted leaves its members teamless.
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.SET_NULL, related_name="members")

    def __str__(self) -> str:
        return self.public_name

    @property
    def public_name(self) -> str:
        """The only name public pages may show: never the e-mail address or the derived username."""
        if self.anonymous:
            return ANONYMOUS_NAME
        return self.display_name or f"Volunteer {self.user_id}"

    @classmethod
    def of(cls, user: Any) -> Profile:
        """The user's profile, created on first use for users that predate profiles or skip sign-up."""
        return cls.objects.get_or_create(user=user)[0]


@receiver(post_save, sender=settings.AUTH_USER_MODEL, dispatch_uid="accounts.create_profile")
def _create_profile(sender: type, instance: Any, created: bool, raw: bool = False, **kwargs: Any) -> None:
    if created and not raw:  # raw: loaddata brings its own profiles
        Profile.objects.get_or_create(user=instance)
