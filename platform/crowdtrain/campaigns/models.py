from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone

from crowdtrain.datasets.models import Dataset, Pretrained


def default_optimizer() -> dict:
    return {
        "name": "adamw",
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "momentum": 0.0,
    }


class Campaign(models.Model):
    """One training run: a model from the registry, a dataset, an optimizer and a global batch size.

    ``committed_steps`` counts steps the scheduler has closed; ``version`` counts
    steps every aggregator has applied (the newest parameters agents can fetch).
    Between the two lies at most the staleness window.
    """

    class State(models.TextChoices):
        DRAFT = "draft"
        RUNNING = "running"
        PAUSED = "paused"
        FINISHED = "finished"
        ARCHIVED = "archived"  # finished and put away: hidden from default lists

    class Visibility(models.TextChoices):
        PUBLIC = "public", "public: any volunteer can join"
        INVITE = "invite", "invite-only: volunteers with the invite link"

    name = models.CharField(max_length=200)
    description = models.TextField(max_length=5000, blank=True)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="campaigns")
    visibility = models.CharField(max_length=16, choices=Visibility.choices, default=Visibility.PUBLIC)
    # Random like a team's invite code; blank until the campaign is first made invite-only.
    invite_code = models.CharField(max_length=64, blank=True, db_index=True, editable=False)
    invited = models.ManyToManyField(settings.AUTH_USER_MODEL, blank=True, related_name="invited_campaigns")
    dataset = models.ForeignKey(Dataset, on_delete=models.PROTECT, related_name="campaigns")
    # Version 0 is these weights instead of the seeded init (the architecture and config are theirs).
    pretrained = models.ForeignKey(
        Pretrained, null=True, blank=True, on_delete=models.PROTECT, related_name="campaigns"
    )
    # The sha256 of the flat vector version 0 is when it is not the pretrained weights as uploaded: an image
    # classifier given a head for the dataset's classes (``pretrained.campaign_weights``); set at the start.
    initial_weights = models.CharField(max_length=64, blank=True)
    architecture = models.CharField(max_length=64)
    model_config = models.JSONField(default=dict)
    optimizer = models.JSONField(default=default_optimizer)
    seed = models.BigIntegerField(default=0)
    target_batch_size = models.PositiveIntegerField(default=256)
    microbatch_size = models.PositiveIntegerField(default=16)
    codec = models.CharField(max_length=16, default="fp32")
    # Elements per scale of the int8 codec (crowdtrain_agent.codec); other codecs have no blocks.
    codec_block_size = models.PositiveIntegerField(default=256, help_text="int8 codec: elements per scale")

    class TrainingMode(models.TextChoices):
        SYNC = "sync", "sync: every lease sends a gradient, one optimizer step per global batch"
        LOCAL = "local", "local: every lease takes inner steps and sends a pseudo-gradient (DiLoCo)"

    training_mode = models.CharField(max_length=8, choices=TrainingMode.choices, default=TrainingMode.SYNC)
    # Local mode's inner optimizer, run by each agent on its copy of the model (the campaign's ``optimizer``
    # is then the outer one); the other hyperparameters are the registry's defaults.
    inner_optimizer = models.CharField(max_length=16, default="adamw")
    inner_lr = models.FloatField(default=1e-3)
    inner_weight_decay = models.FloatField(default=0.0)
    # Samples per inner step (their microbatches' gradients add up); null: one microbatch.
    inner_batch_size = models.PositiveIntegerField(null=True, blank=True)
    staleness = models.PositiveSmallIntegerField(default=1, help_text="0 = fully synchronous")
    num_aggregators = models.PositiveSmallIntegerField(default=1)
    checkpoint_every = models.PositiveIntegerField(default=10)

    class Augmentation(models.TextChoices):
        NONE = "none", "none"
        FLIP = "flip", "random horizontal flips"
        FLIP_CROP = "flip_crop", "random flips and shifted crops"

    # CUDA devices compute forward and backward in bf16 autocast (fp16 with a loss scale without bf16).
    mixed_precision = models.BooleanField(default=True)
    # Image campaigns: what agents do to each training image, seeded by the sample and the version.
    augmentation = models.CharField(max_length=16, choices=Augmentation.choices, default=Augmentation.NONE)
    max_steps = models.PositiveIntegerField(null=True, blank=True)
    # Every this many applied steps (and at the finish) a Celery task computes the held-out loss.
    validate_every = models.PositiveIntegerField(default=10, help_text="steps between validation losses; 0 disables")
    target_val_loss = models.FloatField(
        null=True, blank=True, help_text="finish once the validation loss is at most this"
    )
    # A stranger's finite but huge gradient (say 3e38 everywhere) would still wreck the weights:
    # uploads whose norm per sample is over this are refused. 0 disables the check.
    max_grad_norm = models.FloatField(default=1e4, help_text="per-sample gradient norm bound; 0 disables")

    class Aggregation(models.TextChoices):
        MEAN = "mean", "mean: every sample counts the same"
        TRIMMED_MEAN = "trimmed_mean", "trimmed mean: per coordinate, drop the extremes of the leases"
        CENTERED_CLIP = "centered_clip", "centered clipping: clip each lease's pull towards the median"

    # How aggregators combine a step's leases (crowdtrain_backbone.robust): the robust means count each lease
    # as one vote, so a minority of bad volunteers cannot drag the step anywhere.
    aggregation = models.CharField(max_length=16, choices=Aggregation.choices, default=Aggregation.MEAN)
    # Each lease's norm per sample is clipped to this many times the median of the slice's recent ones. 10
    # is generous on purpose: a lease of 1 sample honestly has up to sqrt(100) = 10 times the norm per sample
    # of one of 100 (gradient noise averages out as 1/sqrt(n), and lease sizes follow device speeds), so
    # honest training is never cut, while a scaled-up gradient is held to 10 times a typical one. 0 disables.
    clip_factor = models.FloatField(default=10.0, help_text="multiple of the recent median norm; 0 disables")
    trim_fraction = models.FloatField(default=0.1, help_text="share of values dropped at each end (trimmed mean)")
    # Read by verification (crowdtrain.verification), not by the aggregators; newcomers get 4x, trusted 1/4.
    check_fraction = models.FloatField(
        default=0.05, help_text="share of leases also computed by another volunteer to verify them"
    )
    param_count = models.BigIntegerField(default=0, editable=False)
    state = models.CharField(max_length=16, choices=State.choices, default=State.DRAFT)
    committed_steps = models.PositiveIntegerField(default=0)
    version = models.PositiveIntegerField(default=0)
    # Rollbacks so far. A step's write counts only if the campaign is still on the timeline its leases were
    # gathered on, and aggregators drop commits of an older one (scheduler.commits, protocol 2.5).
    timeline = models.PositiveIntegerField(default=0, editable=False)
    epoch = models.PositiveIntegerField(default=0)
    cursor = models.BigIntegerField(default=0, help_text="next never-leased sample of the epoch")
    # Names the campaign's hot state in Redis: a fresh value per campaign row, so a database that was
    # reset or restored never meets the keys of a campaign that had the same id before.
    hot_key = models.UUIDField(default=uuid.uuid4, editable=False)
    # Set when a slice lost its state and no checkpoint every slice has can replace it: the campaign
    # waits, with this explanation on its page, until staff restore it (scheduler.recovery).
    blocked_reason = models.CharField(max_length=1000, blank=True, default="", editable=False)
    created_at = models.DateTimeField(default=timezone.now)
    # When the campaign first started, last entered running (a start or a resume), and finished: the
    # organizer's elapsed time and estimate, and the "no step since it started" stall, read them.
    started_at = models.DateTimeField(null=True, blank=True, editable=False)
    running_since = models.DateTimeField(null=True, blank=True, editable=False)
    finished_at = models.DateTimeField(null=True, blank=True, editable=False)

    def __str__(self) -> str:
        return self.name

    def stamp_state(self, now: Any = None) -> list[str]:
        """Record the time of the state just set; returns the fields to save with ``state``."""
        now = now or timezone.now()
        if self.state == self.State.RUNNING:
            self.running_since = now
            if self.started_at is None:
                self.started_at = now
            return ["running_since", "started_at"]
        if self.state == self.State.FINISHED:
            self.finished_at = now
            return ["finished_at"]
        return []

    @property
    def open_step(self) -> int:
        return self.committed_steps

    def is_open_to(self, user: Any) -> bool:
        """Whether ``user`` may work on this campaign: public, or invited, or its owner, or staff."""
        if self.visibility == self.Visibility.PUBLIC:
            return True
        if not getattr(user, "is_authenticated", False):
            return False
        return user.is_staff or self.owner_id == user.pk or self.invited.filter(pk=user.pk).exists()


class ValidationResult(models.Model):
    """The mean loss of the parameters of ``version`` on the dataset's held-out split.

    ``weights`` names the safetensors file (in default storage) of exactly those
    parameters: the export of that version, so an exported model reproduces
    the loss shown here.
    """

    campaign = models.ForeignKey(Campaign, on_delete=models.CASCADE, related_name="validation_results")
    version = models.PositiveIntegerField()
    loss = models.FloatField(null=True, blank=True, help_text="empty when the dataset has no held-out split")
    num_samples = models.PositiveIntegerField()
    weights = models.CharField(max_length=255, blank=True)
    computed_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["campaign", "version"]
        constraints = [models.UniqueConstraint(fields=["campaign", "version"], name="unique_validation_version")]

    def __str__(self) -> str:
        return f"{self.campaign} v{self.version}: {self.loss}"


class Step(models.Model):
    """A committed global step: exactly the leases whose ``step`` points here."""

    campaign = models.ForeignKey(Campaign, on_delete=models.CASCADE, related_name="steps")
    index = models.PositiveIntegerField()
    num_samples = models.PositiveIntegerField()
    loss_sum = models.FloatField()
    committed_at = models.DateTimeField(default=timezone.now)
    applied_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["campaign", "index"]
        constraints = [models.UniqueConstraint(fields=["campaign", "index"], name="unique_step_index")]

    def __str__(self) -> str:
        return f"{self.campaign} step {self.index}"

    @property
    def loss(self) -> float:
        return self.loss_sum / self.num_samples if self.num_samples else float("nan")


class OrganizerRequest(models.Model):
    """A volunteer asking to become an organizer; staff grant or refuse it."""

    class Decision(models.TextChoices):
        PENDING = "pending"
        GRANTED = "granted"
        REFUSED = "refused"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="organizer_requests")
    reason = models.TextField(max_length=2000)
    created = models.DateTimeField(default=timezone.now)
    decision = models.CharField(max_length=16, choices=Decision.choices, default=Decision.PENDING)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    decided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created"]
        constraints = [
            # One open request per volunteer: asking twice changes nothing.
            models.UniqueConstraint(
                fields=["user"], condition=models.Q(decision="pending"), name="one_pending_organizer_request"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.user} ({self.decision})"
