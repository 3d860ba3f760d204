"""Verification records: each volunteer's standing, and the leases computed twice to check one another.

A *check* is one lease picked for verification (the original) and the copies of
it given to agents of other volunteers. The aggregators sketch every upload and
sign the sketch into its receipt, so each *answer* holds a sketch of what an
aggregator really received. Two answers of unrelated volunteers that agree settle
the check; anything else (a disagreement, a copy by a volunteer much like the
original's, a check nobody copied in time) goes to the referee, the operator's
own recomputation (``referee``), which judges each answer on its own.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.models import Campaign

# A volunteer with fewer passed checks than this is on probation (``standing``): a newcomer.
NEWCOMER_CHECKS = 10
# On probation, in good standing, and the last decided check failed: held to copies (``standing.held``).
LOST_LAST_CHECK = models.Q(state="good", checks_failed__gt=0, streak=0, checks_passed__lt=NEWCOMER_CHECKS)


class Standing(models.Model):
    """What a volunteer's verified record says of them, and whether they may work."""

    class State(models.TextChoices):
        GOOD = "good", "in good standing"
        QUARANTINED = "quarantined", "quarantined"
        BANNED = "banned", "banned"

    volunteer = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="standing")
    checks_passed = models.PositiveIntegerField(default=0)
    checks_failed = models.PositiveIntegerField(default=0)
    # Leases whose uploads the aggregators refused for their content (``Refusal``): failed without a check.
    uploads_refused = models.PositiveIntegerField(default=0)
    # Checks the referee decided: an answer that disagreed with the operator's own recomputation lost its ruling.
    rulings_won = models.PositiveIntegerField(default=0)
    rulings_lost = models.PositiveIntegerField(default=0)
    # Passed since the last failure: a long run earns fewer checks (BOINC's adaptive replication).
    streak = models.PositiveIntegerField(default=0)
    state = models.CharField(max_length=12, choices=State.choices, default=State.GOOD, db_index=True)
    reason = models.CharField(max_length=500, blank=True)
    changed_at = models.DateTimeField(null=True, blank=True)
    appeal = models.TextField(max_length=2000, blank=True)
    appealed_at = models.DateTimeField(null=True, blank=True)
    reviewed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        # Each site process reads who is held every few seconds: these rows only, never the whole table.
        indexes = [models.Index(fields=["volunteer"], condition=LOST_LAST_CHECK, name="standing_lost_last_check")]

    def __str__(self) -> str:
        return f"{self.volunteer_id}: {self.get_state_display()}"

    @property
    def checks(self) -> int:
        return self.checks_passed + self.checks_failed

    @property
    def current_appeal(self) -> str:
        """The appeal against the present state; one sent before the state last changed answers an old decision."""
        if not self.appeal or self.appealed_at is None:
            return ""
        if self.changed_at is not None and self.appealed_at < self.changed_at:
            return ""
        return self.appeal


class Check(models.Model):
    """One lease picked for verification, and how its copies came out."""

    class State(models.TextChoices):
        OPEN = "open", "waiting for a copy"
        TIEBREAK = "tiebreak", "waiting for a third copy"  # before the referee (protocol 2.7); none are opened now
        REFEREE = "referee", "waiting for the referee"
        PASSED = "passed", "passed"
        FAILED = "failed", "failed"
        INCONCLUSIVE = "inconclusive", "inconclusive"
        # A dispute the referee could not rule on (its version was not kept, it waited too long): nobody is
        # judged, and the original's credit stays withheld, as one of the two answers was wrong.
        UNRULED = "unruled", "disputed, not ruled"
        ABANDONED = "abandoned", "abandoned"

    campaign = models.ForeignKey(Campaign, on_delete=models.CASCADE, related_name="checks")
    # The original lease; its row may not be written yet (lease records are batched), so no foreign key.
    lease_id = models.BigIntegerField(unique=True)
    volunteer = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="checks")
    base_version = models.PositiveIntegerField()
    ranges = models.JSONField(help_text="[epoch, shard index, start, count] of the original lease")
    num_samples = models.PositiveIntegerField()
    state = models.CharField(max_length=12, choices=State.choices, default=State.OPEN, db_index=True)
    detail = models.CharField(max_length=300, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    decided_at = models.DateTimeField(null=True, blank=True)
    # The lease's credit was granted once the check ended (the commit grants it when the check ended first).
    credited = models.BooleanField(default=False)
    # Sent to the referee (``referee``), and when its recomputation began: the bounds per hour count these.
    disputed_at = models.DateTimeField(null=True, blank=True)
    refereed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["campaign", "state"]),
            models.Index(fields=["state", "credited"]),
            models.Index(fields=["campaign", "refereed_at"]),
            models.Index(fields=["refereed_at"]),
        ]

    def __str__(self) -> str:
        return f"check of lease {self.lease_id} ({self.state})"

    @property
    def open(self) -> bool:
        return self.state in OPEN_STATES


OPEN_STATES = (Check.State.OPEN, Check.State.TIEBREAK, Check.State.REFEREE)


class Answer(models.Model):
    """One computation of a checked lease: the original, a copy, or the copy that breaks a tie."""

    class Role(models.TextChoices):
        ORIGINAL = "original"
        COPY = "copy"
        TIEBREAK = "tiebreak"

    class Verdict(models.TextChoices):
        PENDING = "pending"
        AGREED = "agreed", "agreed with the verdict"
        DISAGREED = "disagreed", "disagreed with the verdict"
        NONE = "none", "no verdict"

    case = models.ForeignKey(Check, on_delete=models.CASCADE, related_name="answers")  # ("check" is Model.check)
    lease_id = models.BigIntegerField(unique=True)
    role = models.CharField(max_length=8, choices=Role.choices)
    volunteer = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="answers")
    device = models.ForeignKey(Device, null=True, on_delete=models.SET_NULL, related_name="answers")
    # The aggregators' sketches of each slice, concatenated in slice order; empty until reported.
    sketch = models.JSONField(default=list)
    reported_at = models.DateTimeField(null=True, blank=True)
    verdict = models.CharField(max_length=10, choices=Verdict.choices, default=Verdict.PENDING)
    cosine = models.FloatField(null=True, blank=True, help_text="against the answer it was judged by")
    norm_ratio = models.FloatField(null=True, blank=True)
    issued_at = models.DateTimeField(default=timezone.now)
    # A copy computed by a volunteer who shares something with the original's (``affinity``): its agreement
    # proves nothing, so the referee decides the check.
    similar = models.BooleanField(default=False)

    class Meta:
        ordering = ["case", "issued_at"]

    def __str__(self) -> str:
        return f"{self.role} of check {self.case_id}: lease {self.lease_id}"


class Refusal(models.Model):
    """An upload an aggregator refused for what it held (NaN values, a malformed payload), once per lease.

    The aggregator says so over its trusted channel (``upload_refused``); the
    volunteer is known once the lease's row is written (rows are batched), and
    then the refusal counts against their standing (``refusals.resolve``).
    """

    campaign = models.ForeignKey(Campaign, on_delete=models.CASCADE, related_name="refusals")
    lease_id = models.BigIntegerField(unique=True)
    slice_index = models.PositiveIntegerField()
    code = models.CharField(max_length=40)
    detail = models.CharField(max_length=300, blank=True)
    volunteer = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="refusals"
    )
    received_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["volunteer", "received_at"])]

    def __str__(self) -> str:
        return f"lease {self.lease_id} refused ({self.code})"


class KeptVersion(models.Model):
    """A campaign's parameters at a version some open check trained on, kept by the site for the referee.

    The aggregators keep a few versions only; a dispute can come after its base
    version left them. Kept from the moment a check opens, deleted once no open
    check needs it (``referee.prune``).
    """

    campaign = models.ForeignKey(Campaign, on_delete=models.CASCADE, related_name="kept_versions")
    version = models.PositiveIntegerField()
    name = models.CharField(max_length=200, help_text="storage name of the flat parameters (safetensors)")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["campaign", "version"], name="verification_kept_version_once")]

    def __str__(self) -> str:
        return f"campaign {self.campaign_id} version {self.version}"
